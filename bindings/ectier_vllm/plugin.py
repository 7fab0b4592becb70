"""vLLM plugin: makes ``"ec_connector": "ECTierConnector"`` work without ``ec_connector_module_path``.

Installing ectier declares the entry point ``ectier = ectier_vllm.plugin:register`` in vLLM's
``vllm.general_plugins`` group (setup.py). vLLM 0.33 calls every such function in each of its
processes (``vllm.plugins.load_general_plugins``: the front end, the engine core before it builds
the scheduler, every worker before it builds the model), so the name is known wherever vLLM's
``ECConnectorFactory`` creates a connector. The long form with ``ec_connector_module_path`` keeps
working (the factory asks its registry first; both name the same class).

Importing this module imports neither torch nor ectier: the connector's module is loaded lazily,
by the factory, only where a connector is created.
"""

from __future__ import annotations

#: the name operators put in ``--ec-transfer-config '{"ec_connector": ...}'``
CONNECTOR_NAME = "ECTierConnector"
CONNECTOR_MODULE = "ectier_vllm.connector"


def register() -> None:
    """Register :data:`CONNECTOR_NAME` with vLLM's ``ECConnectorFactory`` (lazy; idempotent).

    vLLM may load its plugins more than once in a process; a second call is a no-op. Raises
    nothing else than what importing vLLM raises.
    """
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    try:
        ECConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # "Connector 'ECTierConnector' is already registered."
        pass

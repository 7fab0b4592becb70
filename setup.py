"""ectier: a tiered store (GPU -> pinned host -> NVMe) for multimodal encoder outputs."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

setup(
    name="ectier",
    version="0.1.0",
    description="Tiered encoder cache (host memory + NVMe/LMDB) for vision-language model serving",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ectier", "ectier.*"])
    + find_packages(where="bindings", include=["ectier_vllm", "ectier_vllm.*"]),
    package_dir={"ectier_vllm": "bindings/ectier_vllm"},
    install_requires=[
        # users bring vLLM's torch; any 2.x from 2.4 on has what ectier uses (fp8 dtypes, uint views)
        "torch>=2.4,<3",
        "numpy>=1.24",
        "lmdb>=1.4",
        "zstandard>=0.22",
        "xxhash>=3.0",
        "msgpack>=1.0",
        "click>=8.1",
        "rich>=13",
        "PyYAML>=6",
        "prometheus-client>=0.17",
    ],
    extras_require={
        "vllm": ["vllm>=0.33,<0.34"],
        "demo": ["scikit-image>=0.22", "safetensors>=0.4", "matplotlib>=3.8"],  # README: `ectier bench` after demo.sh
        # the remote tier's Redis / Valkey backend (ectier/tiers/remote/redis.py)
        "remote": ["redis>=8"],
        # the remote tier's Mooncake Store backend (ectier/tiers/remote/mooncake.py): the client
        # without CUDA; with CUDA install mooncake-transfer-engine instead. Needs libibverbs1.
        "mooncake": ["mooncake-transfer-engine-non-cuda>=0.3.13; platform_system == 'Linux' and platform_machine == 'x86_64'"],
        "test": ["pytest>=8", "pytest-timeout>=2.2", "pyflakes>=3", "hypothesis>=6.100", "scikit-image>=0.22", "safetensors>=0.4", "matplotlib>=3.8",
                 "pytest-benchmark>=4", "redis>=8",
                 "mooncake-transfer-engine-non-cuda>=0.3.13; platform_system == 'Linux' and platform_machine == 'x86_64'"],
        "bench": ["pytest-benchmark>=4", "matplotlib>=3.8", "safetensors>=0.4", "scikit-image>=0.22"],
    },
    entry_points={
        "console_scripts": ["ectier=ectier.cli:main"],
        # vLLM loads these in every process: registers "ECTierConnector" with its EC connector
        # factory, so --ec-transfer-config needs no ec_connector_module_path (docs/vllm.md)
        "vllm.general_plugins": ["ectier = ectier_vllm.plugin:register"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)

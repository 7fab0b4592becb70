"""The remote tier: encoder outputs shared by every engine on every node, on a distributed store
the deployment already runs (Redis / Valkey Cluster; Mooncake Store). See docs/operations.md."""

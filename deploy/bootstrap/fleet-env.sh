# shellcheck shell=bash
# Environment of every Ray process on a fleet Mac. Sourced by deploy/cluster.yaml's start commands
# and by ~/.bashrc (mac-setup.sh adds it), so drivers (`serve deploy`, scripts) see the same.
MLX_FLEET_HOME="${MLX_FLEET_HOME:-$HOME/mlx-fleet}"
export PATH="$MLX_FLEET_HOME/.venv/bin:/opt/homebrew/bin:$PATH"
# Multi-node Ray on macOS is opt-in; without it a Mac binds loopback and refuses to join.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
# One token for the whole fleet (mac-setup.sh copies the head's to every node).
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH="$HOME/.ray/mlx-fleet-token"
export RAY_USAGE_STATS_ENABLED=0
# Serve's HTTP proxy answers its own errors (a gateway replica lost mid-request, no route) in the OpenAI
# error format too (cluster/api/proxy_errors.py); a Ray process started without this keeps plain text.
export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=cluster.api.proxy_errors.middlewares
# Ray's high-throughput Serve: direct gRPC from the proxy to the gateways and from them to the replicas,
# each deployment's code on its replica's own event loop (docs/batching.md). Its direct ingress (no proxy, a
# port per ingress replica) stays off: the proxy is the front door. Each replica's gRPC server listens on a
# free port the OS picks (deploy/README.md, Ports).
export RAY_SERVE_THROUGHPUT_OPTIMIZED=1
export RAY_SERVE_ENABLE_DIRECT_INGRESS=0
export RAY_SERVE_PROXY_USE_GRPC=1
# The node's name is a label for people; its id (unique, persistent) is made once in its data dir.
export MLX_FLEET_NODE_NAME="${MLX_FLEET_NODE_NAME:-$(hostname -s)}"
export MLX_FLEET_DATA_DIR="${MLX_FLEET_DATA_DIR:-$HOME/.mlx-fleet}"
export MLX_FLEET_NODE_DATA_DIR="${MLX_FLEET_NODE_DATA_DIR:-$MLX_FLEET_DATA_DIR/node}"

"""`mlx-fleet deploy FILE`: deploy or update the Serve app on a running Ray cluster, and wait for it.

The file is the one `serve deploy` takes (deploy/serve.yaml): Ray's own schema
checks its shape, a key that schema has no field for is refused (Serve itself
drops it silently), and each mlx-fleet application's `args` goes through the
same AppConfig the CLI uses, so a misspelt key is refused, by name, before
anything reaches the cluster. Then, like `serve deploy`, the config is PUT to
the dashboard's Serve API (Ray adds the cluster's auth token when
RAY_AUTH_MODE=token), and we poll until every replica is healthy, printing
progress, then the endpoint and the dashboard.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlparse

import yaml

from cluster.config import AppConfig, did_you_mean, first_error

APP_IMPORT_PATH = "cluster.actors.app:build_app"
DEFAULT_DASHBOARD = "http://127.0.0.1:8265"


class DeployError(ValueError):
    """The file is wrong (named field, and how to fix it) or the cluster would not take it."""


def load_serve_file(path: Path) -> dict:
    """The file as Ray reads it, checked by Ray's schema and, for our apps, by AppConfig."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        with open(path, encoding="utf-8") as f:  # a stream: YAML's errors then name the file, not "<unicode string>"
            raw = yaml.load(f, Loader=_UniqueKeyLoader)
    except OSError as e:
        raise DeployError(f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise DeployError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(raw, dict) or not raw.get("applications"):
        raise DeployError(f"{path}: `applications` is missing or empty; see deploy/serve.yaml for the shape")
    try:
        ServeDeploySchema.parse_obj(raw)
    except Exception as e:  # Ray's pydantic error: its text names the field
        raise DeployError(f"{path}: not a Serve config: {e}") from None
    unknown = unknown_key(ServeDeploySchema, raw)
    if unknown:
        raise DeployError(f"{path}: {unknown}")
    for i, app in enumerate(raw["applications"]):
        where = app.get("import_path", "")
        ours = where.replace(":", ".") == APP_IMPORT_PATH.replace(":", ".")  # Ray takes module.attr as module:attr
        if not ours and where.startswith("cluster.actors."):
            raise DeployError(f"{path}: applications[{i}].import_path: {where!r} is not mlx-fleet's application; "
                              f"did you mean {APP_IMPORT_PATH}?")
        if not ours:
            continue
        try:
            AppConfig.model_validate(app.get("args") or {})
        except ValidationError as e:
            field, msg = first_error(e, AppConfig)
            raise DeployError(f"{path}: applications[{i}].args.{field}: {msg} "
                              f"(the fields and what they mean: cluster/config.py, or `mlx-fleet up --help`)") from None
    return raw


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: PyYAML (and so Serve)
    keeps the last one without a word, so the first `data_dir:` of two would be lost."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the base loader refuses it, with its own message
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def unknown_key(schema, data, where: str = "") -> str:
    """The first key of `data` that `schema` (one of Ray's pydantic Serve schemas) has no field for, named by
    its path with the closest field names, or "". Serve drops such keys without a word: `htp_options:` would
    deploy on the default port, and the dashboard would show nothing wrong. The schema is this machine's
    Ray's, pinned to the fleet's (pyproject.toml), so the message says which Ray it speaks for."""
    import ray

    if not isinstance(data, dict):
        return ""
    fields = schema.model_fields
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            hint = did_you_mean(str(key), fields) or f"here it takes {', '.join(fields)}"
            return f"{path}: Ray {ray.__version__}'s Serve has no such setting; {hint}"
        for inner, item_path, item in _models_in(fields[key].annotation, value, path):
            found = unknown_key(inner, item, item_path)
            if found:
                return found
    return ""


def _models_in(annotation, value, path: str):
    """(pydantic model, path, part of `value`) for each model a field's type holds: the type itself, each
    item of a list, or an alternative of an Optional/Union (next to a plain dict, which is not walked:
    Ray leaves a dict open)."""
    import types
    import typing

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, path, value
    elif typing.get_origin(annotation) is list:
        (inner,) = typing.get_args(annotation) or (None,)
        for i, item in enumerate(value if isinstance(value, list) else []):
            yield from _models_in(inner, item, f"{path}[{i}]")
    elif typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for inner in typing.get_args(annotation):
            yield from _models_in(inner, value, path)


def dashboard_address(explicit: Optional[str] = None) -> str:
    """--address, else RAY_DASHBOARD_ADDRESS, else RAY_ADDRESS (an http(s) URL as it is; a head's
    `host:port` means that host's dashboard on its default port 8265), else the local head's dashboard."""
    if explicit and not explicit.startswith(("http://", "https://")):
        raise DeployError(f"--address {explicit!r}: give the dashboard's URL, e.g. http://<head>:8265")
    for candidate in (explicit, os.environ.get("RAY_DASHBOARD_ADDRESS"), os.environ.get("RAY_ADDRESS")):
        if candidate and candidate.startswith(("http://", "https://")):
            return candidate.rstrip("/")
    address = os.environ.get("RAY_ADDRESS", "")
    host = address.removeprefix("ray://").rsplit(":", 1)[0] if ":" in address else ""
    if host and host not in ("auto", "local"):
        return f"http://{host}:8265"
    return DEFAULT_DASHBOARD


def deploy(path: Path, address: Optional[str] = None, timeout_s: float = 900.0,
           progress: Callable[[str], None] = print) -> dict:
    """Deploy `path` and wait until every application runs with healthy replicas; returns Serve's details."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    config = load_serve_file(path)
    url = dashboard_address(address)
    try:
        client = ServeSubmissionClient(url)
    except ConnectionError as e:
        raise DeployError(f"no Ray dashboard answers at {url} ({e}); is the cluster up (`ray up`), and is this "
                          "its head's address (--address http://<head>:8265)?") from None
    except Exception as e:  # e.g. Ray's AuthenticationError: its message says where the token is looked for
        raise DeployError(f"the dashboard at {url} refused us: {e}") from None
    try:
        client.deploy_applications(config)
    except Exception as e:
        raise DeployError(f"the cluster at {url} refused the deploy: {e}") from None
    progress(f"deploying {len(config['applications'])} application(s) to {url} ...")
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        details = client.get_serve_details()
        line, done, failed = summarize(details, [a["name"] for a in config["applications"]])
        if line != last:
            progress(f"  {line}")
            last = line
        if failed:
            raise DeployError(f"deploy failed: {failed}")
        if done:
            return details
        if time.monotonic() > deadline:
            raise DeployError(f"not every replica was healthy after {timeout_s:.0f} s: {line}")
        time.sleep(2)


def summarize(details: dict, names: list[str]) -> tuple[str, bool, str]:
    """(one progress line, every app running with every replica healthy, why it failed or "")."""
    apps = details.get("applications") or {}
    parts, done, failed = [], True, ""
    for name in names:
        app = apps.get(name) or {}
        status = app.get("status", "NOT_STARTED")
        deployments = app.get("deployments") or {}
        running = sum(1 for d in deployments.values() for r in d.get("replicas") or [] if r.get("state") == "RUNNING")
        wanted = sum(int((d.get("target_num_replicas") or 0)) for d in deployments.values())
        parts.append(f"{name}: {status}, {running}/{wanted or '?'} replicas running")
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            failed = f"{name}: {app.get('message') or status}"
        done = done and status == "RUNNING" and wanted > 0 and running >= wanted
    return "; ".join(parts), done, failed


def endpoint(config: dict, dashboard: str) -> str:
    """The HTTP endpoint clients use: the head's address, on Serve's port."""
    port = (config.get("http_options") or {}).get("port", 8000)
    host = urlparse(dashboard).hostname or "127.0.0.1"
    return f"http://{host}:{port}/v1"


def main(path: str, address: Optional[str], timeout_s: float) -> int:
    url = dashboard_address(address)
    details = deploy(Path(path), url, timeout_s)
    config = load_serve_file(Path(path))
    print(f"mlx-fleet is deployed: {summarize(details, [a['name'] for a in config['applications']])[0]}")
    print(f"  endpoint:  {endpoint(config, url)}")
    print(f"  dashboard: {url}")
    sys.stdout.flush()
    return 0

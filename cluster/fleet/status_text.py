"""Human-readable `mlx-fleet status`."""

from __future__ import annotations


def render(status: dict) -> str:
    lines = [f"endpoint:  {status.get('endpoint')}/v1", f"dashboard: {status.get('dashboard') or '-'}",
             _redis_line(status.get("redis", {})), "", "nodes:"]
    for n in status["nodes"]:
        host = f"[{n['address']}]" if ":" in str(n["address"]) else n["address"]  # an IPv6 address in a URL
        metrics = f"  metrics http://{host}:{n['metrics_port']}/metrics" if n.get("metrics_port") else ""
        lines.append(f"  {n['name']:<10} {n.get('node_id') or '-':<22} {'alive' if n['alive'] else 'DEAD ':<6} "
                     f"{n['address']}{metrics}")
        lines.append("      " + _disk_line(n.get("disk")))
    lines += ["", "replicas:"]
    if status.get("replicas_source") == "serve":
        lines.append("  (Redis is unreachable: per-replica detail is unavailable; counts below come from Serve)")
    for r in status["replicas"]:
        prompt = r.get("prompt_tokens", 0)
        reuse = f"{r.get('cached_tokens', 0) / prompt:.0%}" if prompt else "-"
        # The counters are the replica process's own: a restarted replica starts them again (the disk and the
        # fleet's route counters keep theirs), so say since when they count.
        lines.append(f"  {r['model']:<20} on {r['node_id']:<22} active={r.get('active', 0):<3} "
                     f"requests={r.get('requests', 0):<6} tokens: prompt={prompt:<8} cached={r.get('cached_tokens', 0):<8} "
                     f"reuse={reuse:<5} completion={r.get('completion_tokens', 0)} "
                     f"backend={r.get('backend') or '-'} (since it started {_age(r)} ago)")
        lines.append("      " + _batch_line(r))
        if r.get("broken"):
            lines.append(f"      BROKEN: {r['broken']}")
        if r.get("shards"):
            sh = r["shards"]
            lines.append(f"      shards: {sh['size']} ({sh['mode']} parallel, {sh.get('backend', 'ring')}) over "
                         + ", ".join(f"rank {n.get('rank', i)} {n['node_id']}" + (" (leads)" if i == 0 else "")
                                     for i, n in enumerate(sh["nodes"])))
            for n in sh["nodes"][1:]:  # each follower's own cache (its heads' blocks, on its node)
                if n.get("cache"):
                    lines.append(f"      rank {n.get('rank')} {_cache_line(n['cache'])}{_rank_reads(n['cache'])}")
        lines.append("      " + _cache_line(r.get("cache", {})))
        if (r.get("cache") or {}).get("enabled"):
            lines.append("      " + _hot_path_line(r["cache"]))
    fleet = status.get("fleet") or {}
    if fleet:
        reuse = f"{fleet['reuse']:.0%}" if fleet.get("reuse") is not None else "-"
        routes = ", ".join(f"{k} {v}" for k, v in sorted((fleet.get("routes") or {}).items())) or "-"
        entries = sum(sum(per.values()) for per in (fleet.get("index_entries") or {}).values())
        lines += ["", "fleet:",
                  f"  reuse {reuse} of prompt tokens (fetched from peers: {fleet.get('fetched_tokens', 0)} tokens), "
                  f"routes: {routes}",
                  f"  migrated {fleet.get('migrated_blocks', 0)} blocks {fleet.get('migrated_bytes', 0) / 2**20:.1f} MiB"
                  f" ({fleet.get('migration_failures', 0)} failed), index {entries} entries (a block or checkpoint "
                  f"once per node and tier holding it), lookup p50 "
                  f"{fleet.get('lookup_ms_p50') or '-'} ms p99 {fleet.get('lookup_ms_p99') or '-'} ms"]
    lines += ["", "models:"]
    for m in status["models"]:
        where = ", ".join(m["nodes"]) if m["nodes"] else ("-" if m["nodes"] is not None else "(nodes unknown)")
        lines.append(f"  {m['name']:<20} {m['replicas']} replica(s): {where}")
    return "\n".join(lines)


def _age(replica: dict) -> str:
    """How long the replica process had run when it last renewed its lease: 42s, 3m05s, 2h07m."""
    started, renewed = replica.get("started"), replica.get("renewed")
    if not started or not renewed:
        return "-"
    s = max(0, int(renewed - started))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _redis_line(redis: dict) -> str:
    state = "reachable" if redis.get("reachable") else f"UNREACHABLE ({redis.get('error') or '-'})"
    restarts = f", restarted {redis['restarts']} time(s) by the supervisor" if redis.get("supervised") else ""
    if redis.get("supervised") and redis.get("supervisor_running") is False:
        restarts += (", but the supervisor is NOT running: a Redis that stops stays down "
                     "(`mlx-fleet down`, then `up`, starts a new one)")
    return f"redis:     {redis.get('url') or '-'} {state}{restarts}"


def _batch_line(r: dict) -> str:
    b = r.get("batching") or {}
    stages = (f"decoding {r.get('decoding', 0)}, waiting {r.get('waiting', 0)}, "
              f"{r.get('queued_tokens', 0)} prompt tokens to prefill, {r.get('streams', 0)} in flight")
    det = b.get("deterministic") or "off"
    det = "" if det == "off" else f"; deterministic: {det}"
    if not b.get("batching"):
        return f"batching: off ({b.get('reason') or '-'}); {stages}{det}"
    return (f"batching: up to {b['decode_concurrency']} decoding, {b['prefill_concurrency']} prefilling, "
            f"mean batch {b['mean_batch']} over {b['batched_steps']} steps; {stages}{det}")


def _cache_line(cache: dict) -> str:
    if not cache.get("enabled"):
        return f"cache: off ({cache.get('reason', '-')})"
    ram = cache["ram"]
    bad = {k: v for k, v in cache.get("corrupt", {}).items() if v}
    spill = cache.get("spill")
    spill_text = (f", spill queued {spill['queued']} spilled {spill['spilled']} dropped {spill['dropped_spills']}"
                  if spill else ", disk off")
    return (f"cache {cache['namespace']}, {cache['block_tokens']}-token blocks: ram {ram['blocks']} blocks "
            f"{ram['bytes'] / 2**20:.1f}/{ram['budget'] / 2**20:.0f} MiB, served {ram['hits']} blocks, {ram['misses']} "
            f"not in RAM, evictions {ram['evictions']}, stored {cache['blocks_stored']} blocks "
            f"{cache['checkpoints_stored']} checkpoints, corrupt {bad or 0}{spill_text}")


def _rank_reads(cache: dict) -> str:
    """A follower's reads at its leader's word, and what it pulled from its counterparts (kvcache/shard_restore.py)."""
    if not cache.get("enabled"):
        return ""
    restore, pulled = cache.get("shard_restore") or {}, cache.get("migration") or {}
    return (f", its reads {restore.get('reads', 0)} ({restore.get('late_reads', 0)} late), pulled "
            f"{pulled.get('blocks', 0)} blocks ({pulled.get('failures', 0)} failed)")


def _hot_path_line(cache: dict) -> str:
    """What the RAM tier holds, the prompt tails, the restore-or-recompute choices and the spill backlog."""
    costs = cache.get("costs") or {}
    choices = costs.get("choices") or {}
    backlog = cache.get("spill_backlog")
    return (f"ram holds {cache['ram'].get('holds', '-')}, tails stored {cache.get('tails_stored', 0)} "
            f"hit {cache.get('tail_hits', 0)}, chose restore {choices.get('restore', 0)} recompute "
            f"{choices.get('recompute', 0)} (prefill {costs.get('prefill_tps', 0)} tok/s, ram "
            f"{costs.get('ram_gbps', 0)} GB/s, disk {costs.get('disk_gbps', 0)} GB/s, "
            f"to the device {costs.get('move_gbps', 0)} GB/s, spill writes {costs.get('write_gbps', 0)} GB/s)"
            + (f", spill backlog {backlog['blocks']} blocks {backlog['bytes'] / 2**20:.1f} MiB" if backlog else ""))


def _disk_line(disk) -> str:
    if not disk:
        return "disk: -"
    quarantined = sum(disk.get("quarantined", {}).values())
    state = f" DEGRADED ({disk['degraded']['reason']})" if disk.get("degraded") else ""
    return (f"disk: {disk['blocks']} blocks {disk['bytes'] / 2**20:.1f} MiB of {disk['budget'] / 2**30:.1f} GiB, "
            f"served {disk['hits']} blocks, {disk['misses']} not on disk, evictions {disk['evictions']}, "
            f"quarantined {quarantined}, dropped spills {disk['dropped_spills']}{state}")

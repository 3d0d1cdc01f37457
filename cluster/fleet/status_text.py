"""Human-readable `mlx-fleet status`."""

from __future__ import annotations


def render(status: dict) -> str:
    lines = [f"endpoint:  {status.get('endpoint')}/v1", f"dashboard: {status.get('dashboard') or '-'}", "", "nodes:"]
    for n in status["nodes"]:
        lines.append(f"  {n['node_id']:<12} {'alive' if n['alive'] else 'DEAD ':<6} {n['address']}")
    lines += ["", "replicas:"]
    for r in status["replicas"]:
        lines.append(f"  {r['model']:<20} on {r['node_id']:<10} active={r.get('active', 0):<3} "
                     f"requests={r.get('requests', 0):<6} prompt={r.get('prompt_tokens', 0):<8} "
                     f"cached={r.get('cached_tokens', 0):<8} completion={r.get('completion_tokens', 0)}")
    lines += ["", "models:"]
    for m in status["models"]:
        lines.append(f"  {m['name']:<20} {m['replicas']} replica(s): {', '.join(m['nodes']) or '-'}")
    if status.get("redis", {}).get("error"):
        lines.append(f"\nredis: {status['redis']['error']}")
    return "\n".join(lines)

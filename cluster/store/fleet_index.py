"""The fleet-wide prefix index in Redis: which node holds how much of a prompt, in one round trip.

Key schema, per model fingerprint namespace (ns = the first 16 bytes of the
fingerprint, hex). `{...}` is a Redis Cluster hash tag: all of a namespace's
keys live in one slot, so one Lua script can read them all.

    mlxf:{ns}:nodes                 SET  node ids that announced in this namespace
    mlxf:{ns}:live:<node>           STR  the node's lease: msgpack {generation, stats...}, PX lease ttl
    mlxf:{ns}:gen:<node>            INT  generation: +1 every time the node's replica (re)starts
    mlxf:{ns}:kv:<node>:ram         SET  block ids (first 16 bytes) the node holds in RAM
    mlxf:{ns}:kv:<node>:disk        SET  ... on its disk
    mlxf:{ns}:ck:<node>:ram|disk    SET  block ids whose end-of-block recurrent checkpoint it holds

          prompt -> chain ids b0 b1 b2 b3 ...
                       |
      lookup(ns, ids) -+-> for each node in :nodes with a live lease
                            hit  = longest i with b0..bi in kv:<node>:ram U kv:<node>:disk
                            ram  = longest run in RAM, disk = longest run on disk (what a peer can serve)
                            ck   = largest j <= hit whose b(j-1) is in ck:<node>:*  (hybrids)

Holders of a block b are {n : b in kv:<n>:*, live:<n> exists}: the relation is
stored per node (one set per node and tier) rather than per block. That costs
one set member per (node, block) and no key per block, lets a lookup stop at a
node's first miss, and makes a node's whole contribution one DEL away: a node
whose lease expired is ignored by every lookup at once, and its sets are
garbage-collected by any live node of the namespace.

Ids are the first 16 bytes of the 32-byte chain ids: the index only advises
routing (the replica verifies every block it restores), and 128 bits do not
collide in practice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

import msgpack

log = logging.getLogger(__name__)

ID_BYTES = 16
TIERS = ("ram", "disk")
CHUNK = 2000  # members per SADD/SREM command

LOOKUP = """
local prefix, max_ck = ARGV[1], tonumber(ARGV[2])
local ids = {}
for i = 3, #ARGV do ids[i - 2] = ARGV[i] end
local n = #ids
local out = {}
-- Lua's unpack() holds at most ~8000 values: no call takes more than MAX ids.
local MAX = 4096
local function member_of(key, first, last)
  local got = {}
  for lo = first, last, MAX do
    local part = redis.call('SMISMEMBER', key, unpack(ids, lo, math.min(last, lo + MAX - 1)))
    for k = 1, #part do got[lo + k - first] = part[k] end
  end
  return got
end
for _, node in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local lease = redis.call('GET', prefix .. 'live:' .. node)
  if lease then
    local hit, ram, disk, ck, ck_disk = 0, 0, 0, 0, 0
    if n > 0 then
      -- SMISMEMBER in chunks that double (8, 16, 32, ...) until a miss: a node that holds nothing
      -- costs two small calls, one that holds h blocks about 2 log(h) calls over ~2h ids.
      local kr, kd = prefix .. 'kv:' .. node .. ':ram', prefix .. 'kv:' .. node .. ':disk'
      local r, d = {}, {}
      local ram_run, disk_run, first, size, open = true, true, 1, 8, true
      while open and first <= n do
        local last = math.min(n, first + size - 1)
        local rr = member_of(kr, first, last)
        local dd = member_of(kd, first, last)
        for k = 1, last - first + 1 do
          local i = first + k - 1
          r[i], d[i] = rr[k], dd[k]
          if rr[k] == 0 and dd[k] == 0 then open = false break end
          hit = i
          if ram_run and rr[k] == 1 then ram = i else ram_run = false end
          if disk_run and dd[k] == 1 then disk = i else disk_run = false end
        end
        first, size = last + 1, math.min(size * 2, MAX)
      end
      local top = math.min(hit, max_ck)
      if top > 0 then
        local cr = member_of(prefix .. 'ck:' .. node .. ':ram', 1, top)
        local cd = member_of(prefix .. 'ck:' .. node .. ':disk', 1, top)
        for j = top, 1, -1 do
          if ck == 0 and (cr[j] == 1 or cd[j] == 1) then ck = j end
          if ck_disk == 0 and j <= disk and cd[j] == 1 then ck_disk = j end
          if ck > 0 and ck_disk > 0 then break end
        end
      end
    end
    table.insert(out, {node, hit, ram, disk, ck, ck_disk, lease})
  end
end
return out
"""

GC = """
local prefix = ARGV[1]
local removed = {}
for _, node in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', prefix .. 'live:' .. node) == 0 then
    for _, kind in ipairs({'kv', 'ck'}) do
      for _, tier in ipairs({'ram', 'disk'}) do redis.call('DEL', prefix .. kind .. ':' .. node .. ':' .. tier) end
    end
    redis.call('SREM', KEYS[1], node)
    table.insert(removed, node)
  end
end
return removed
"""


def short(ns: bytes) -> str:
    return ns[:16].hex()


def prefix(ns: bytes) -> str:
    return f"mlxf:{{{short(ns)}}}:"


def nodes_key(ns: bytes) -> str:
    return prefix(ns) + "nodes"


def live_key(ns: bytes, node: str) -> str:
    return f"{prefix(ns)}live:{node}"


def gen_key(ns: bytes, node: str) -> str:
    return f"{prefix(ns)}gen:{node}"


def set_key(ns: bytes, kind: str, node: str, tier: str) -> str:
    """kind: "kv" (blocks) or "ck" (end-of-block checkpoints); tier: "ram" or "disk"."""
    return f"{prefix(ns)}{kind}:{node}:{tier}"


def member(block_id: bytes) -> bytes:
    return block_id[:ID_BYTES]


@dataclass(frozen=True)
class Holding:
    """What one live node holds of a prompt, in blocks from the first."""

    node_id: str
    hit: int  # leading blocks in RAM or on disk
    ram: int  # leading blocks in RAM
    disk: int  # leading blocks on disk (what a peer can be sent from its node store)
    ck: int  # largest j <= hit with a checkpoint at the end of block j-1 (0: none / not hybrid)
    ck_disk: int  # the same among blocks on disk
    lease: dict = field(default_factory=dict)


class FleetIndex:
    """Reads and writes the index over one Redis client (sync or asyncio: see lookup / alookup)."""

    def __init__(self, client):
        self.client = client
        self._lookup = client.register_script(LOOKUP)
        self._gc = client.register_script(GC)

    # -- reads -----------------------------------------------------------------------
    def lookup_args(self, ns: bytes, ids: list[bytes], max_ck: int) -> tuple[list, list]:
        return [nodes_key(ns)], [prefix(ns), max_ck, *(member(i) for i in ids)]

    def lookup(self, ns: bytes, ids: list[bytes], max_ck: int = 0) -> list[Holding]:
        """One round trip, whatever the prompt's length: every live node's holding of `ids`."""
        keys, args = self.lookup_args(ns, ids, max_ck)
        return parse(self._lookup(keys=keys, args=args))

    async def alookup(self, ns: bytes, ids: list[bytes], max_ck: int = 0) -> list[Holding]:
        keys, args = self.lookup_args(ns, ids, max_ck)
        return parse(await self._lookup(keys=keys, args=args))

    def nodes(self, ns: bytes) -> list[str]:
        return sorted(m.decode() for m in self.client.smembers(nodes_key(ns)))

    def size(self, ns: bytes) -> dict[str, int]:
        """Members per node (all tiers and kinds), for status."""
        out = {}
        for node in self.nodes(ns):
            pipe = self.client.pipeline(transaction=False)
            for kind in ("kv", "ck"):
                for tier in TIERS:
                    pipe.scard(set_key(ns, kind, node, tier))
            out[node] = sum(pipe.execute())
        return out

    # -- writes (one writer per node and namespace: the node's replica) ---------------------
    def apply(self, ns: bytes, node: str, changes: dict[tuple[str, str], tuple[set, set]]) -> None:
        """Add and remove members: {(kind, tier): (added ids, removed ids)}, one pipeline."""
        pipe = self.client.pipeline(transaction=False)
        pipe.sadd(nodes_key(ns), node)
        for (kind, tier), (added, removed) in changes.items():
            key = set_key(ns, kind, node, tier)
            for chunk in _chunks([member(i) for i in removed]):
                pipe.srem(key, *chunk)
            for chunk in _chunks([member(i) for i in added]):
                pipe.sadd(key, *chunk)
        pipe.execute()

    def replace(self, ns: bytes, node: str, tier: str, kv: Iterable[bytes], ck: Iterable[bytes]) -> None:
        """The node's whole holding in one tier, atomically (a full announce or a resync)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.sadd(nodes_key(ns), node)
        for kind, ids in (("kv", kv), ("ck", ck)):
            key = set_key(ns, kind, node, tier)
            pipe.delete(key)
            for chunk in _chunks([member(i) for i in ids]):
                pipe.sadd(key, *chunk)
        pipe.execute()

    def renew(self, ns: bytes, node: str, lease: dict, ttl_ms: int, existing_only: bool = False) -> bool:
        """Write the node's lease; True if it was still there (False: Redis lost it - announce again).
        `existing_only` (the periodic renewal) writes nothing when it is gone: a lease back before the
        node's blocks would show it live and empty to every lookup until the announce that follows."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(live_key(ns, node), msgpack.packb(lease), px=ttl_ms, get=True, xx=existing_only)
        pipe.sadd(nodes_key(ns), node)
        previous, _ = pipe.execute()
        return previous is not None

    def next_generation(self, ns: bytes, node: str) -> int:
        return int(self.client.incr(gen_key(ns, node)))

    def withdraw(self, ns: bytes, node: str) -> None:
        """A clean shutdown: the node's entries stop counting at once."""
        self.client.delete(live_key(ns, node))

    def collect(self, ns: bytes) -> list[str]:
        """Delete the entries of nodes whose lease expired; return them."""
        return [n.decode() for n in self._gc(keys=[nodes_key(ns)], args=[prefix(ns)])]


def parse(rows) -> list[Holding]:
    out = []
    for node, hit, ram, disk, ck, ck_disk, lease in rows:
        try:
            stats = msgpack.unpackb(lease, strict_map_key=False)
        except Exception:  # a lease is advice; a bad one is an empty one
            stats = {}
        out.append(Holding(node.decode() if isinstance(node, bytes) else node, int(hit), int(ram), int(disk),
                           int(ck), int(ck_disk), stats if isinstance(stats, dict) else {}))
    return sorted(out, key=lambda h: h.node_id)


def _chunks(items: list) -> Iterable[list]:
    for i in range(0, len(items), CHUNK):
        yield items[i:i + CHUNK]

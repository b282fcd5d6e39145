"""Context parallelism: one sequence sharded along its length over the ranks of a process group,
exchanging only the key/value blocks that the pattern reads (``zoo.attention(..., cp_group=)``).

- ``shards``: which global positions each rank holds (contiguous, or head-tail for causal load
  balance), and ``shard`` / ``unshard`` to cut a whole sequence and join it again;
- ``exchange_plan``: which key rows each rank fetches from each other rank, and which wide query
  rows it ships, from the block states of the pattern at the global length;
- ``exchange``: the differentiable point-to-point fetch, and ``SwapRows`` for wide rows;
- ``routed_plan``: a pattern chosen by content (MoBA): the block sums the ranks add up, the
  choice per chunk, and a plan made per call;
- ``wide``: wide query rows (global tokens) computed where their keys are, merged by log-sum-exp;
- ``at_positions``: the global pattern seen through one rank's rows;
- ``sharded``: the call, its agreement between ranks, and ``shard_stats`` (``zoo.explain``);
- ``sharded_module``: ``zoo.MultiHeadAttention`` on a shard, and ``use_context_parallel``.
"""

from .exchange_plan import PLAN_BLOCK, ExchangePlan, exchange_plan
from .sharded import ShardStats, context_parallel_attention, shard_stats
from .sharded_module import use_context_parallel
from .shards import ORDERS, ShardLayout, shard, unshard

__all__ = [
    "ORDERS", "PLAN_BLOCK", "ExchangePlan", "ShardLayout", "ShardStats",
    "context_parallel_attention", "exchange_plan", "shard", "shard_stats", "unshard",
    "use_context_parallel",
]  # fmt: skip

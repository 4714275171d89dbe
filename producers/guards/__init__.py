"""Trainer-side guards (docs/guards.md): a circuit breaker for components the loop calls,
rollout validation, the reward-distribution gate, prompt de-duplication and checkpoint
manifests. No Kafka needed; given the trainer's ``TrainerLogger`` (``events=``) each guard
publishes its decisions and counts as metrics (``guard/...``) that rules judge."""

from trainguard.producers.guards.breaker import (
    BreakerOpen,
    CallTimeout,
    CircuitBreaker,
    ScoreCache,
    trl_reward_func,
    verl_compute_score,
)
from trainguard.producers.guards.checkpoint import CheckpointError, check_checkpoint, newest_verified, write_manifest
from trainguard.producers.guards.dedup import PromptDeduplicator
from trainguard.producers.guards.reward_gate import RewardGate, Verdict
from trainguard.producers.guards.validation import RolloutValidator

__all__ = ["BreakerOpen", "CallTimeout", "CheckpointError", "CircuitBreaker", "PromptDeduplicator", "RewardGate",
           "RolloutValidator", "ScoreCache", "Verdict", "check_checkpoint", "newest_verified", "trl_reward_func",
           "verl_compute_score", "write_manifest"]

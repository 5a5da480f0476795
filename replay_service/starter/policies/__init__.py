"""Policies for the replay service: schedule and random baselines and a loader."""

from replay_service.starter.policies.schedule import (
    POLICY_CHOICES,
    SchedulePolicy,
    load_policy,
    make_random_policy,
)

__all__ = ["POLICY_CHOICES", "SchedulePolicy", "load_policy", "make_random_policy"]

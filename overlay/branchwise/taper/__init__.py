"""TAPER: per-step branch admission (pure logic, no SGLang import). See policies.py for the caller's loop."""

from branchwise.taper.planner import plan_step
from branchwise.taper.policies import (
    POLICY_NAMES,
    VALID_POLICIES,
    CapPolicy,
    Policy,
    TaperPolicy,
    parse_policy,
    parse_policy_name,
)
from branchwise.taper.predictor import (
    ConstantLatencyModel,
    LatencyModel,
    LinearLatencyModel,
    OnlineRefit,
    default_model,
    load_model,
    mape,
    model_from_json,
)
from branchwise.taper.slack import SlackTracker, phase_slack, serial_slack, slack_budget
from branchwise.taper.state import BatchView, RequestView, StepPlan
from branchwise.taper.utility import CONCAVE, LINEAR, PRIORITY, UTILITY_NAMES, Utility, parse_utility

__all__ = [
    "BatchView", "CONCAVE", "CapPolicy", "ConstantLatencyModel", "LINEAR", "LatencyModel",
    "LinearLatencyModel", "OnlineRefit", "POLICY_NAMES", "PRIORITY", "Policy", "RequestView",
    "SlackTracker", "StepPlan", "TaperPolicy", "UTILITY_NAMES", "Utility", "VALID_POLICIES",
    "default_model", "load_model", "mape", "model_from_json", "parse_policy", "parse_policy_name",
    "parse_utility", "phase_slack", "plan_step", "serial_slack", "slack_budget",
]

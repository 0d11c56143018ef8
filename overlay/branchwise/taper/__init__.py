"""TAPER: per-step branch admission (pure logic, no SGLang import).

One decode step reads top to bottom: controller.py (rows in, active rows out; the slack clocks)
-> policies.py (the policy's rules as data) -> planner.py (the greedy plan over an ArrayBatch)
-> predictor.py (the step-latency model T(S)) and utility.py (marginal gains).
"""

from branchwise.taper.controller import Row, SlackTracker, StepController, StepStats
from branchwise.taper.planner import ArrayBatch, StepPlan, plan_capped, plan_step
from branchwise.taper.policies import (
    POLICY_NAMES,
    VALID_POLICIES,
    Policy,
    Terms,
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
from branchwise.taper.utility import CONCAVE, LINEAR, PRIORITY, UTILITY_NAMES, Utility, parse_utility

__all__ = [
    "ArrayBatch", "CONCAVE", "ConstantLatencyModel", "LINEAR", "LatencyModel", "LinearLatencyModel",
    "OnlineRefit", "POLICY_NAMES", "PRIORITY", "Policy", "Row", "SlackTracker", "StepController",
    "StepPlan", "StepStats", "Terms", "UTILITY_NAMES", "Utility", "VALID_POLICIES", "default_model",
    "load_model", "mape", "model_from_json", "parse_policy", "parse_policy_name", "parse_utility",
    "plan_capped", "plan_step",
]

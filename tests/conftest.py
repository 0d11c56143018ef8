"""Hypothesis runs without its per-example deadline: a property test's verdict must not depend on how
loaded the box is (a 2-core machine under load runs an example in over the default 200 ms)."""

from hypothesis import settings

settings.register_profile("branchwise", deadline=None)
settings.load_profile("branchwise")

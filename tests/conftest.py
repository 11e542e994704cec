"""Loads the Hypothesis profile of the fuzz tests: ``GPU_DRA_FUZZ=ci`` (default) or ``full``."""

from hypothesis import settings

from tests.fuzzing import PROFILE

settings.load_profile(PROFILE)

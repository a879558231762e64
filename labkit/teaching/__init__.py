"""What turns code into a lesson: claims computed and checked from this run's values, the
notebook's start, exercise checks with their hints, and predictions revealed against the
measurement."""
from labkit.teaching.truth import Claim, assert_claims_held, claim, claims, reset_claims

__all__ = ["Claim", "assert_claims_held", "claim", "claims", "reset_claims"]

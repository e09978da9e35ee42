"""`--pass-option PASS.FIELD=VALUE` (passmanager.with_pass_options): values parsed by the
field's type, "auto" for the options the pass decides when left None."""

from __future__ import annotations

import pytest

from hloplan.diagnostics import UsageError
from hloplan.passmanager import pass_pipeline, with_pass_options


def _passes(*settings: str) -> dict:
    return with_pass_options({p.name: p for p in pass_pipeline()}, settings)


def test_options_left_to_the_pass_take_a_value_of_their_type_or_auto() -> None:
    passes = _passes("build-sharding-problem.min_launch_s=0.001",
                     "propagate-sharding.constrain_implied=false")
    assert passes["build-sharding-problem"].min_launch_s == 0.001
    assert passes["propagate-sharding"].constrain_implied is False
    passes = _passes("build-sharding-problem.min_launch_s=auto",
                     "propagate-sharding.constrain_implied=auto")
    assert passes["build-sharding-problem"].min_launch_s is None
    assert passes["propagate-sharding"].constrain_implied is None


def test_a_value_of_another_type_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="is not a float"):
        _passes("build-sharding-problem.min_launch_s=soon")
    with pytest.raises(UsageError, match="is not a bool"):
        _passes("propagate-sharding.constrain_implied=maybe")

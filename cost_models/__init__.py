"""Hardware models and the analytic communication cost model.

Device models are TOML files shipped in this package (see `hardware` for the schema);
`collectives.CommModel` prices collectives and resharding over mesh axes with them.
"""

from hloplan.cost_models.collectives import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    COLLECTIVE_KINDS,
    REDUCE_SCATTER,
    AxisGroup,
    CommModel,
    ReshardCost,
    Sharding,
    local_bytes,
)
from hloplan.cost_models.hardware import (
    PLATFORMS,
    DeviceModel,
    DeviceModelError,
    Interconnect,
    available_device_models,
    axis_links,
    load_device_model,
    normalize_dtype,
)

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "COLLECTIVE_KINDS",
    "PLATFORMS",
    "REDUCE_SCATTER",
    "AxisGroup",
    "CommModel",
    "DeviceModel",
    "DeviceModelError",
    "Interconnect",
    "ReshardCost",
    "Sharding",
    "available_device_models",
    "axis_links",
    "load_device_model",
    "local_bytes",
    "normalize_dtype",
]

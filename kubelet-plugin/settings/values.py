"""Value syntaxes of the plugin's flags that more than one flag group reads: booleans
(`parse_bool`) and NVIDIA's ``--feature-gates`` (`parse_feature_gates`), whose gates the
settings' ``*_enabled`` properties consult. See docs/config.md#gpu-dra-kubelet-plugin.
"""

from __future__ import annotations

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off", ""})


def parse_bool(text: str, what: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off, any case); ValueError names `what`."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{what} must be true or false, got {text!r}")


# NVIDIA's driver feature gates (nvidia-compat.md §10) and what gpu-dra does with them.
GATE_DYNAMIC_MIG = "DynamicMIG"
GATE_HEALTH_CHECK = "NVMLDeviceHealthCheck"
GATES_ALWAYS_ON = frozenset({"TimeSlicingSettings", "MPSSupport"})
"""Behaviour gpu-dra always has: accepted either way, no effect."""
GATES_NOT_IMPLEMENTED = frozenset(
    {
        "IMEXDaemonsWithDNSNames",
        "PassthroughSupport",
        "ComputeDomainCliques",
        "CrashOnNVLinkFabricErrors",
        "DeviceMetadata",
        "DRAListTypeAttributes",
        "FabricManagerPartitioning",
        "HostManagedIMEXDaemon",
        "ConsumableShares",
    }
)
"""Accepted when false; true is an error, as gpu-dra does not implement them."""


def parse_feature_gates(text: str) -> tuple[str, ...]:
    """NVIDIA's ``--feature-gates`` / ``FEATURE_GATES`` (``K1=v1,K2=v2,``): the gates turned on.

    ``DynamicMIG`` turns on dynamic MIG, ``NVMLDeviceHealthCheck`` the health monitor;
    ``TimeSlicingSettings`` and ``MPSSupport`` are always on in gpu-dra; NVIDIA's other gates may
    only be false. Unknown names are an error.
    """
    enabled = []
    for item in text.split(","):
        if not item.strip():
            continue
        name, separator, raw = item.partition("=")
        name = name.strip()
        if not separator:
            raise ValueError(f"feature gate {item.strip()!r} must be written Name=true|false")
        value = parse_bool(raw, f"feature gate {name}")
        if name in (GATE_DYNAMIC_MIG, GATE_HEALTH_CHECK) or name in GATES_ALWAYS_ON:
            pass
        elif name in GATES_NOT_IMPLEMENTED:
            if value:
                raise ValueError(f"feature gate {name} is not implemented by gpu-dra")
        else:
            known = sorted(
                {GATE_DYNAMIC_MIG, GATE_HEALTH_CHECK, *GATES_ALWAYS_ON, *GATES_NOT_IMPLEMENTED}
            )
            raise ValueError(f"unknown feature gate {name!r}; known: {', '.join(known)}")
        if value:
            enabled.append(name)
    return tuple(dict.fromkeys(enabled))

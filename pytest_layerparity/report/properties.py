"""A test's reported values as (name, value) pairs: what JUnit XML, xdist and the reports
carry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..compare.metrics import METRIC_NAMES
from .fields import FIELD_NAMES

if TYPE_CHECKING:
    from ..compare.judge import LayerOutcome


def reported_metrics(props: dict[str, Any]) -> dict[str, Any]:
    """The metrics among a test's (unprefixed) properties, for report entries."""
    return {k: props[k] for k in FIELD_NAMES if k in props}


def properties(outcome: LayerOutcome, prefix: str = "") -> list[tuple[str, Any]]:
    """(name, value) pairs for record_property / JUnit XML."""
    m = outcome.metrics
    out = [(f"{prefix}{name}", getattr(m, name)) for name in METRIC_NAMES]
    out += [
        (f"{prefix}nan_count", m.golden_nan + m.target_nan),
        (f"{prefix}inf_count", m.golden_inf + m.target_inf),
        (f"{prefix}has_nan", bool(m.golden_nan or m.target_nan)),
        (f"{prefix}has_inf", bool(m.golden_inf or m.target_inf)),
        (f"{prefix}worst_index", list(m.worst_index)),
        (f"{prefix}worst_golden", m.worst_golden),
        (f"{prefix}worst_target", m.worst_target),
    ]
    noise = outcome.floor
    if noise is not None:
        out += [(f"{prefix}noise_ratio", noise.noise_ratio), (f"{prefix}token_noise_ratio", noise.token_noise_ratio)]
        if noise.contribution_bias is not None:
            out.append((f"{prefix}contribution_bias", noise.contribution_bias))
        if noise.delta_cosine is not None:
            out.append((f"{prefix}delta_cosine", noise.delta_cosine))
        out += [(f"{prefix}branch_bias_{name}", value) for name, value in noise.branch_bias.items()]
        out += [(f"{prefix}branch_move_{name}", value) for name, value in noise.branch_move.items()]  # a bug's reading
    limits = outcome.envelope
    if limits is not None:
        out += [
            (f"{prefix}noise_ratio_limit", limits.max_noise_ratio),
            (f"{prefix}token_noise_ratio_limit", limits.max_token_noise_ratio),
            (f"{prefix}contribution_bias_low", limits.bias_low),
            (f"{prefix}contribution_bias_high", limits.bias_high),
            (f"{prefix}envelope_samples", limits.samples),
            (f"{prefix}envelope_method", limits.method),  # a float16 golden's family: which runs held it
        ]
        for name, (low, high) in limits.branch_bias.items():
            out += [(f"{prefix}branch_bias_{name}_low", low), (f"{prefix}branch_bias_{name}_high", high)]
        if limits.control is not None:  # the limits a same-device control drew (or could have)
            out.append((f"{prefix}controllable", True))
            out += [(f"{prefix}control_{name}", value) for name, value in limits.control.items()]
    if outcome.prompt_kv is not None:  # a prompt test's: the keys and values its call wrote
        out.append((f"{prefix}prompt_kv", outcome.prompt_kv))
        for check in outcome.checks:
            if check.name.startswith("prompt_"):
                out.append((f"{prefix}{check.name}", check.value))
                if check.name.endswith("_noise_ratio"):
                    out.append((f"{prefix}{check.name}_limit", check.limit))
    from ..compare.diagnosis import diagnose

    diagnosis = diagnose(outcome)
    if diagnosis is not None:
        out += [(f"{prefix}diagnosis", diagnosis.part), (f"{prefix}diagnosis_text", diagnosis.describe())]
    if outcome.sight is not None:  # what the test could see: its detection limits
        out += outcome.sight.properties(prefix)
    if outcome.picture is not None:  # a failing outcome's, for report.html (compact JSON)
        out.append((f"{prefix}failure_picture", outcome.picture.to_json()))
    routings = outcome.routing
    if routings:
        tokens = sum(r.tokens for r in routings)
        same = sum(r.tokens - r.flipped for r in routings)
        out += [
            (f"{prefix}routing_agreement", same / tokens if tokens else 1.0),
            (f"{prefix}routing_flipped", sum(r.flipped for r in routings)),
            (f"{prefix}routing_near_tie_flipped", sum(r.near_tie_flipped for r in routings)),
        ]
    return out

"""The one table of what a test reports: each field's name (the same in failure text, JUnit
properties, report.json, report.csv and the plots), in order, and where it is shown."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Field:
    """A reported value. ``column``: its place, title and width in the terminal summary
    (None: not shown there); ``csv``: a column of report.csv and report.html; ``plot``: a
    panel of the plot across layers."""

    name: str
    column: tuple[int, str, int] | None = None
    csv: bool = False
    plot: bool = False


FIELDS: tuple[Field, ...] = (
    # the five metrics (compare.metrics.METRIC_NAMES), first and in this order
    Field("max_abs_diff", (0, "max_abs_diff", 12), csv=True, plot=True),
    Field("mean_abs_diff", (1, "mean_abs_diff", 13), csv=True, plot=True),
    Field("similarity_percentage", (4, "similar%", 9), csv=True),
    Field("cosine_similarity", (2, "cosine", 10), csv=True, plot=True),
    Field("pearson_correlation", (3, "pearson", 10), csv=True, plot=True),
    # against the precision floor
    Field("noise_ratio", (5, "noise_ratio", 11), csv=True, plot=True),
    Field("token_noise_ratio", (6, "token_ratio", 11), csv=True, plot=True),
    Field("contribution_bias", csv=True, plot=True),
    Field("delta_cosine"),
    # the limits drawn from the layer's noise envelope
    Field("noise_ratio_limit", csv=True),
    Field("token_noise_ratio_limit", csv=True),
    Field("contribution_bias_low", csv=True),
    Field("contribution_bias_high", csv=True),
    Field("envelope_samples"),
    # the test's detection limits (compare.sight): the smallest change of each kind it fails on
    Field("detection_attention_scale", csv=True),
    Field("detection_mlp_scale", csv=True),
    Field("detection_temperature", csv=True),
    Field("detection_norm_epsilon", csv=True),
    Field("detection_gelu_form"),
    Field("detection_text"),
    # mixture-of-experts routing
    Field("routing_agreement", (7, "routing", 8), csv=True),
    Field("routing_flipped", csv=True),
    Field("routing_near_tie_flipped", csv=True),
    # non-finite values and the worst element
    Field("nan_count", csv=True),
    Field("inf_count", csv=True),
    Field("worst_index"),
    Field("worst_golden"),
    Field("worst_target"),
    # decode steps: the steps judged, those that failed, and the keys and values appended
    Field("decode_steps", csv=True),
    Field("failing_steps"),
    Field("new_keys_cosine", csv=True),
    Field("new_keys_noise_ratio", csv=True),
    Field("new_values_cosine", csv=True),
    Field("new_values_noise_ratio", csv=True),
    Field("new_keys_positions"),
    Field("new_values_positions"),
    Field("kv_cache_appended"),
    # a linear-attention layer's decode steps: the states it left in its cache entry
    Field("new_conv_states_cosine"),
    Field("new_conv_states_noise_ratio"),
    Field("new_recurrent_states_cosine"),
    Field("new_recurrent_states_noise_ratio"),
    Field("new_conv_states_positions"),
    Field("new_recurrent_states_positions"),
    # the prompt's KV cache: whether the keys and values its call wrote (to an empty cache) were
    # judged, or why not, and how they compare with the golden's
    Field("prompt_kv"),
    Field("prompt_keys_cosine", csv=True),
    Field("prompt_keys_noise_ratio", csv=True),
    Field("prompt_keys_noise_ratio_limit", csv=True),
    Field("prompt_values_cosine", csv=True),
    Field("prompt_values_noise_ratio", csv=True),
    Field("prompt_values_noise_ratio_limit", csv=True),
    Field("prompt_keys_positions"),
    Field("prompt_values_positions"),
    # the whole model's next-token distributions
    Field("positions", csv=True),
    Field("top1_agreement", csv=True),
    Field("topk_overlap", csv=True),
    Field("kl_divergence", csv=True),
    Field("kl_divergence_mean"),
    Field("kl_divergence_max"),
    Field("kl_divergence_limit", csv=True),
    Field("logit_scale", csv=True),
    Field("logit_scale_low"),
    Field("logit_scale_high"),
    Field("first_divergence", csv=True),
    Field("near_tie_flips", csv=True),
    Field("near_tie_margin"),
    Field("margin_drift"),
    Field("greedy_flips_outside_ties", csv=True),
    Field("generated", csv=True),
    Field("generated_matched", csv=True),
)

FIELD_NAMES = tuple(f.name for f in FIELDS)
CSV_FIELDS = tuple(f.name for f in FIELDS if f.csv)
PLOTTED = tuple(f.name for f in FIELDS if f.plot)
SUMMARY_COLUMNS = tuple(
    (title, f.name, width) for _, title, width, f in sorted((*f.column, f) for f in FIELDS if f.column)
)
# report.csv: the test, its layers and verdict, then the fields
CSV_COLUMNS = ("nodeid", "layers", "verdict", *CSV_FIELDS)

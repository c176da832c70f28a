"""The options of the verdict: the limits of a layer's differences and of its noise envelope."""

from __future__ import annotations

from .declaration import Option
from .parsers import NEAR_TIES, correlation, non_negative_int, percentage, probability, tolerance

VERDICT_OPTIONS = (
    Option(
        "max_abs_diff",
        "--max-abs-diff",
        "Fail when max_abs_diff is above this. Default: 0.01.",
        type=tolerance,
        default=0.01,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "max_mean_abs_diff",
        "--max-mean-abs-diff",
        "Fail when mean_abs_diff is above this. Default: 0.001.",
        type=tolerance,
        default=0.001,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "min_similarity",
        "--min-similarity",
        "Fail when similarity_percentage (share of elements with |target - golden| <= 0.01 + 0.01 * |golden|) is "
        "below this. Default: 95.",
        type=percentage,
        default=95.0,
        ini=True,
        cli=False,
        metavar="PCT",
    ),
    Option(
        "min_cosine",
        "--min-cosine",
        "Fail when cosine_similarity is below this. Default: 0.99 (noise policy, float32 goldens: 0.9999).",
        type=correlation,
        default=None,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "min_pearson",
        "--min-pearson",
        "Fail when pearson_correlation is below this. Default: 0.99.",
        type=correlation,
        default=0.99,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "verdict",
        "--verdict",
        "Verdict policy: noise (error in units of the golden's own rounding error, against the stored float32 "
        "evaluation) or table (the fixed thresholds above). Default: noise.",
        choices=("noise", "table"),
        default="noise",
        ini=True,
    ),
    Option(
        "max_noise_ratio",
        "--max-noise-ratio",
        "Noise policy: fail when ||target - ref|| / ||golden - ref|| is above this. Default: 1.5.",
        type=tolerance,
        default=None,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "max_token_noise_ratio",
        "--max-token-noise-ratio",
        "Noise policy: fail when any token's noise ratio is above this. Default: 3.",
        type=tolerance,
        default=None,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "max_contribution_z",
        "--max-contribution-bias",
        "Noise policy: fail when the target's error along the layer's own contribution (output - input) is more than "
        "this many noise units. Default: 6.",
        type=tolerance,
        default=None,
        ini=True,
        cli=False,
        metavar="Z",
    ),
    Option(
        "false_alarm_rate",
        "--false-alarm-rate",
        "Noise policy: the probability that a correct layer fails, from which the limits are drawn out of the "
        "layer's noise envelope. Default: 0.001.",
        type=probability,
        default=1e-3,
        ini=True,
        cli=False,
        metavar="P",
    ),
    Option(
        "envelope_samples",
        "--envelope-samples",
        "Perturbed runs (Monte Carlo arithmetic) of each layer that make its noise envelope, at extraction and "
        "for each chained run (the whole model's envelope takes half as many and one); 0: none (fixed limits). "
        "Default: 12.",
        type=non_negative_int,
        default=12,
        ini=True,
        metavar="K",
    ),
    Option(
        "near_ties",
        "--near-ties",
        "Tokens whose MoE routing flipped on a near tie: leave-out (reported, and left out of the noise policy's "
        "checks), exclude (left out of the output metrics too) or strict (counted in the verdict like any other "
        "token). Default: leave-out.",
        choices=NEAR_TIES,
        default="leave-out",
        ini=True,
    ),
    Option(
        "router_tie_tolerance",
        "--router-tie-tolerance",
        "A router margin (gap between the k-th and k+1-th logit over the largest) below this many units of the "
        "dtype's epsilon is a near tie. Default: 8.",
        type=tolerance,
        default=8.0,
        ini=True,
        cli=False,
        metavar="N",
    ),
    Option(
        "no_precision_floor",
        "--no-precision-floor",
        "Extraction: skip the higher-precision evaluation of each layer (the noise policy then falls back to the "
        "table policy for these goldens).",
        action="store_true",
        default=False,
    ),
)

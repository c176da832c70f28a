"""One test's row of the reports (:class:`ReportEntry`): what the terminal summary,
report.json, report.csv and report.html show of it. Built in one place per source: from a
pytest run's test reports (:meth:`ReportEntry.of_test`) and by the offline compare
(:func:`..offline.compare_stores`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest


def _picture(props: dict[str, Any]) -> str | None:
    """The failure picture a test recorded: its own, else the first of a chain's layers'."""
    if "failure_picture" in props:
        return props["failure_picture"]
    return next((v for k, v in props.items() if k.endswith(".failure_picture")), None)


def skip_reason(report: pytest.TestReport) -> str:
    """What a skipped test's skip said (a test that judged nothing says why), else ''."""
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return ""


@dataclass
class ReportEntry:
    """A test (or, offline, a layer) as the reports show it.

    ``layers``: ``"3"``, ``"0-2"``, ``"model"``; ``verdict``: ``pass``, ``fail``, ``error``,
    ``skipped`` (or what the test recorded); ``metrics``: the reported fields
    (:mod:`.fields`) it carries; ``message``: the failure text, or a skip's reason.
    ``properties`` (its dotted properties, ``layer_N.<field>`` of a chain) and ``placement``
    (where the reference ran) come with the tests of a pytest run; the offline compare's
    entries carry neither (``properties`` None), and their report.json objects leave both out.
    """

    nodeid: str
    layers: str
    verdict: str
    metrics: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    properties: dict[str, Any] | None = None
    placement: str | None = None
    decode_note: str | None = None  # an extraction's: why it wrote no decode steps
    picture: str | None = None  # a failing test's FailurePicture (JSON): its own, or its chain's first failing layer's

    @classmethod
    def of_test(cls, report: pytest.TestReport) -> ReportEntry:
        """The entry of a layerparity test's call (or failed setup) report, from the
        properties it recorded (also those of an xdist worker, carried by the report)."""
        from .properties import reported_metrics

        props = dict(report.user_properties)
        verdict = props.get("verdict") or (
            "error" if report.when == "setup" else "pass" if report.passed else "skipped" if report.skipped else "fail"
        )
        if report.failed and verdict == "pass":
            verdict = "fail"
        return cls(
            nodeid=report.nodeid,
            layers=props.get("layers", report.nodeid.rsplit("[", 1)[-1].rstrip("]").split("_", 1)[-1]),
            verdict=verdict,
            metrics=reported_metrics(props),
            message=report.longreprtext if report.failed else skip_reason(report),
            properties={k: v for k, v in props.items() if "." in k},
            placement=props.get("placement"),
            decode_note=props.get("decode_note"),
            picture=_picture(props),
        )

    @property
    def test_name(self) -> str:
        """The test's name and parameters, without its module: ``test_layer_parity[layer_3]``."""
        return self.nodeid.split("::")[-1]

    def to_json(self) -> dict[str, Any]:
        """The entry's object in report.json."""
        out: dict[str, Any] = {
            "nodeid": self.nodeid,
            "layers": self.layers,
            "verdict": self.verdict,
            "metrics": self.metrics,
            "message": self.message,
        }
        if self.properties is not None:
            out["properties"] = self.properties
            out["placement"] = self.placement
        return out

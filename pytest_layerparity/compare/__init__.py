"""Stage 4, the judgement, pure arithmetic on tensors and settings: the metrics
(:mod:`.metrics`), the statistics against the precision floor (:mod:`.floor`), routing
agreement (:mod:`.routing_agreement`), thresholds and the verdict (:mod:`.verdict`), and the judge
that puts them together (:mod:`.judge`)."""

"""Stage 1, the reference side: the model folder (:mod:`.source`: its config and skeleton,
:mod:`.model`; its weights, :mod:`.checkpoint`), its placement and memory plan
(:mod:`.placement`, :mod:`.plan`, :mod:`.streaming`, :mod:`.memory`, :mod:`.audit`), the golden
input (:mod:`.inputs`), the precision floor (:mod:`.floor`) and the extraction (:mod:`.extract`)."""

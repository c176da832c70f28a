"""Stage 1, the reference side: the model folder (:mod:`.model`), its placement and memory
plan (:mod:`.placement`, :mod:`.plan`, :mod:`.streaming`, :mod:`.audit`), the golden input
(:mod:`.inputs`), the precision floor (:mod:`.floor`) and the extraction (:mod:`.extract`)."""

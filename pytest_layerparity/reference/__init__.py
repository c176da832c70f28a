"""The extraction: the model placed and its memory planned (:mod:`.placement`, :mod:`.plan`,
:mod:`.audit`), the golden input (:mod:`.inputs`), the goldens written (:mod:`.extract`) and
bound to the weights they were made from (:mod:`.binding`)."""

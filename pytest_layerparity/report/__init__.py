"""Stage 5, what people and CI read: the reported fields (:mod:`.fields`), failure text and
the session summary (:mod:`.text`), JUnit properties (:mod:`.properties`), each test's row
of the reports (:mod:`.entry`) and the report files (:mod:`.files`)."""

"""The target side: build the layer under test and run it on the target device
(:mod:`.runner`), chains and bisection (:mod:`.chains`), the op-by-op drill-down into a
failing layer (:mod:`.op_compare`)."""

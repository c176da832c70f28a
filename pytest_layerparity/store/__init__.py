"""Stage 2, the golden store, the contract between the reference and the target machines:
safetensors files and a manifest (:mod:`.golden`), the call-spec encoding (:mod:`.callspec`,
its KV-cache nodes in :mod:`.kv_nodes`),
what ties a store to its extraction (:mod:`.identity`) and the commands that (re)write it
(:mod:`.commands`)."""

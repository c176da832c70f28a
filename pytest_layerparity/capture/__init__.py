"""Forward hooks that record what modules do, used on both sides: a layer's whole call
(:mod:`.calls`) and its routers' expert choices (:mod:`.router_hooks`). Hooks are always removed."""

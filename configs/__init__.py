"""``r3bridge.configs``: the defaults file ``r3bridge.yaml``, shipped as package data so an installed
r3bridge has it too: ``importlib.resources.files("r3bridge.configs") / "r3bridge.yaml"``."""

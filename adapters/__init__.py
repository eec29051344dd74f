"""Framework adapters (verl, SkyRL, AReaL): importable as ``r3bridge.adapters``."""

"""The conformance kit: checks 1-5 an adapter passes (``conformance``, as plain functions; ``suite``,
as pytest base classes), the canonical rollouts they run on and the runner contract of checks 4-5.
Nothing is imported here (``r3bridge.testing`` lists the modules and their names)."""

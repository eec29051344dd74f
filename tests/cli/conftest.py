"""The made-up framework adapter under madeup/ is its own project, tested the way its author runs it
(``python -m pytest`` in that folder, by test_madeup_adapter.py): not collected from here."""
collect_ignore = ["madeup"]

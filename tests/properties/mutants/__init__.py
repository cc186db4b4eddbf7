"""Mutant engines: the reference with one realistic bug each (the suite's power)."""

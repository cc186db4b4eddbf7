"""The packaged conformance tests under the public name: ``pytest --pyargs
kvconform.conformance --kv-engine mypkg.adapter:make_engine`` runs one test per property
of ``kvconform check``, one per check each property runs and one per listed expected
failure (see :mod:`properties.tools.conformance`); an engine's own test folder collects
them with ``from kvconform.conformance import test_check, test_property, test_xfail``."""

from __future__ import annotations

from properties.tools.conformance import test_check, test_property, test_xfail

__all__ = ["test_check", "test_property", "test_xfail"]

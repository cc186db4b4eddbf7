"""The packaged conformance tests under the public name: ``pytest --pyargs
kvconform.conformance --kv-engine mypkg.adapter:make_engine`` runs one test per property
of ``kvconform check`` (see :mod:`properties.tools.conformance`); an engine's own test
folder collects them with ``from kvconform.conformance import test_property``."""

from __future__ import annotations

from properties.tools.conformance import test_property

__all__ = ["test_property"]

"""Tests that drive a real engine installed under ``.engines/`` (marker ``engine``)."""

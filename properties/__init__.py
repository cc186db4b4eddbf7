"""kvconform package."""

"""Helpers the test tiers share: test doubles, reference computations, statistics and paths.

Test files import from here, never from each other.
"""

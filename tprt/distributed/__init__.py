"""Ranks and how they talk: the TP/DP context (`context`), the local launcher (`launcher`)."""

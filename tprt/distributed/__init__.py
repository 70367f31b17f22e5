"""Ranks and how they talk: the TP/DP context (`context`), starting ranks (`launcher`), the typed
messages between them (`protocol`) and the two ends of that conversation (`ranks`)."""

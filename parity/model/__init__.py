"""Model facts: the Ling3 config, the canonical point names and site graph, the MTP points, the semantic forks."""

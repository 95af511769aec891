"""What the collate function and the batch hooks share: items, batch checks, statistics, records."""

"""The lease tables of a replica's leases (_liveness.py), in the task store's database: one row
per replica (its beat) and one per run of ``execute()``, and the read of the runs whose replica
is gone."""

from __future__ import annotations

from typing import Any

from a2a_cancelfix._databases import Dialect, create_index

REPLICAS = "a2a_cancelfix_replicas"
RUNS = "a2a_cancelfix_runs"


# The replica ids of the run rows with no replica row: each distinct id found by one step of
# the index on replica_id (a skip scan), so that no run row is read but an orphan's.
GONE_SQL = f"""
WITH RECURSIVE ids(replica_id) AS (
    SELECT MIN(replica_id) FROM {RUNS}
    UNION ALL
    SELECT (SELECT MIN(replica_id) FROM {RUNS} WHERE replica_id > ids.replica_id)
    FROM ids WHERE ids.replica_id IS NOT NULL
)
SELECT ids.replica_id FROM ids
WHERE ids.replica_id IS NOT NULL
AND NOT EXISTS (SELECT 1 FROM {REPLICAS} WHERE {REPLICAS}.replica_id = ids.replica_id)
"""


class LeaseTables:
    """Our two tables (SQLAlchemy is there with a2a-sdk's database extras only)."""

    def __init__(self, dialect: Dialect) -> None:
        import sqlalchemy as sa

        self.dialect = dialect
        self.metadata = sa.MetaData()
        self.replicas = sa.Table(
            REPLICAS,
            self.metadata,
            sa.Column("replica_id", sa.String(64), primary_key=True),
            sa.Column("beat", sa.BigInteger, nullable=False),
            sa.Column("lease_ms", sa.BigInteger, nullable=False),
        )
        self.runs = sa.Table(
            RUNS,
            self.metadata,
            sa.Column("store", sa.String(255), primary_key=True),  # The task table's name.
            sa.Column("task_id", sa.String(255), primary_key=True),
            sa.Column("replica_id", sa.String(64), nullable=False, index=True),
            sa.Column("owner", sa.String(255), nullable=False),
        )

    def create(self, connection: Any) -> None:
        """Create what is missing, ``IF NOT EXISTS``: a check first, then a create, is a race
        another replica's creation can win (SQLite then fails the create)."""
        import sqlalchemy as sa

        for table in self.metadata.sorted_tables:
            connection.execute(sa.schema.CreateTable(table, if_not_exists=True))
            for index in table.indexes:
                create_index(connection, index, self.dialect)

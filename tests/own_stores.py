"""Task stores of a user's own, as teams write them: one over a dict, one on SQLAlchemy with a
schema of its own (``my_tasks(id, owner, body JSON)``); each with a slow write a test can hold,
and a variant with the compare-and-set save (``save_unless_final``) that a2a-cancelfix guards
through across replicas."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from a2a.server.context import ServerCallContext
from a2a.server.tasks import TaskStore
from a2a.types import ListTasksRequest, ListTasksResponse, Task, TaskState
from google.protobuf.json_format import MessageToDict, ParseDict
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from a2a_cancelfix.testing import Gate

ENDS = (
    TaskState.TASK_STATE_COMPLETED,
    TaskState.TASK_STATE_FAILED,
    TaskState.TASK_STATE_CANCELED,
    TaskState.TASK_STATE_REJECTED,
)
ENDS_NAMES = [TaskState.Name(state) for state in ENDS]


def owner_of(context: ServerCallContext) -> str:
    user = context.user
    return user.user_name if user.is_authenticated else ""


class SlowWrites:
    """A write that takes a while: the next one of a task in a state held by `hold` waits at
    its gate (an asyncio.Event underneath), on its way to the backend."""

    def __init__(self) -> None:
        self.held: dict[int, Gate] = {}
        self.saves = 0  # Writes that reached the backend, through either method.

    def hold(self, state: int) -> Gate:
        """Hold the next write of a task in ``state`` until the returned gate opens."""
        gate = self.held[state] = Gate()
        return gate

    async def on_the_way(self, task: Task) -> None:
        gate = self.held.pop(task.status.state, None)
        if gate is not None:
            await gate()
        self.saves += 1


class DictStore(TaskStore, SlowWrites):
    """A store over a dict, ``{(owner, task id): the serialised task}``. Two stores given one
    dict are two replicas' views of one backend."""

    def __init__(self, backing: dict[tuple[str, str], bytes] | None = None) -> None:
        SlowWrites.__init__(self)
        self.backing: dict[tuple[str, str], bytes] = {} if backing is None else backing

    async def save(self, task: Task, context: ServerCallContext) -> None:
        await self.on_the_way(task)
        self.backing[(owner_of(context), task.id)] = task.SerializeToString()

    async def get(self, task_id: str, context: ServerCallContext) -> Task | None:
        kept = self.backing.get((owner_of(context), task_id))
        return None if kept is None else Task.FromString(kept)

    async def list(self, params: ListTasksRequest, context: ServerCallContext) -> ListTasksResponse:
        owner = owner_of(context)
        tasks = [Task.FromString(kept) for (who, _), kept in self.backing.items() if who == owner]
        return ListTasksResponse(tasks=tasks, total_size=len(tasks))

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        self.backing.pop((owner_of(context), task_id), None)


class CasDictStore(DictStore):
    """`DictStore` with the compare-and-set save: the check and the write, with no await between."""

    async def save_unless_final(self, task: Task, context: ServerCallContext) -> int | None:
        await self.on_the_way(task)
        key = (owner_of(context), task.id)
        kept = self.backing.get(key)
        if kept is not None and (state := Task.FromString(kept).status.state) in ENDS:
            return state
        self.backing[key] = task.SerializeToString()
        return None


metadata = sa.MetaData()
my_tasks = sa.Table(
    "my_tasks",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("owner", sa.String(128), nullable=False),
    sa.Column("body", sa.JSON, nullable=False),
)


class SqlStore(TaskStore, SlowWrites):
    """A SQLAlchemy store of its own schema: a row per task, the task as JSON."""

    def __init__(self, engine: AsyncEngine) -> None:
        SlowWrites.__init__(self)
        self.engine = engine

    async def create(self) -> None:
        async with self.engine.begin() as connection:
            await connection.run_sync(metadata.create_all)

    def _this(self, task_id: str, context: ServerCallContext) -> Any:
        return sa.and_(my_tasks.c.id == task_id, my_tasks.c.owner == owner_of(context))

    async def save(self, task: Task, context: ServerCallContext) -> None:
        await self.on_the_way(task)
        body = MessageToDict(task)
        async with self.engine.begin() as connection:
            updated = await connection.execute(
                sa.update(my_tasks).where(self._this(task.id, context)).values(body=body)
            )
            if updated.rowcount == 0:
                await connection.execute(
                    sa.insert(my_tasks).values(id=task.id, owner=owner_of(context), body=body)
                )

    async def get(self, task_id: str, context: ServerCallContext) -> Task | None:
        async with self.engine.connect() as connection:
            body = await connection.scalar(sa.select(my_tasks.c.body).where(self._this(task_id, context)))
        return None if body is None else ParseDict(body, Task())

    async def list(self, params: ListTasksRequest, context: ServerCallContext) -> ListTasksResponse:
        async with self.engine.connect() as connection:
            bodies = await connection.scalars(
                sa.select(my_tasks.c.body).where(my_tasks.c.owner == owner_of(context))
            )
            tasks = [ParseDict(body, Task()) for body in bodies]
        return ListTasksResponse(tasks=tasks, total_size=len(tasks))

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        async with self.engine.begin() as connection:
            await connection.execute(sa.delete(my_tasks).where(self._this(task_id, context)))


class CasSqlStore(SqlStore):
    """`SqlStore` with the compare-and-set save: a conditional UPDATE (the stored state not
    terminal), else an INSERT of a task not stored yet; else the stored terminal state."""

    async def save_unless_final(self, task: Task, context: ServerCallContext) -> int | None:
        await self.on_the_way(task)
        body = MessageToDict(task)
        state = my_tasks.c.body["status"]["state"].as_string()
        live = sa.or_(state.is_(None), state.not_in(ENDS_NAMES))
        while True:
            async with self.engine.begin() as connection:
                written = await connection.execute(
                    sa.update(my_tasks).where(self._this(task.id, context), live).values(body=body)
                )
                if written.rowcount == 1:
                    return None
                stored = await connection.scalar(sa.select(state).where(self._this(task.id, context)))
                if stored is not None:
                    return TaskState.Value(stored)
                try:
                    async with connection.begin_nested():
                        await connection.execute(
                            sa.insert(my_tasks).values(id=task.id, owner=owner_of(context), body=body)
                        )
                    return None
                except IntegrityError:
                    pass  # Another replica inserted it meanwhile: the conditional UPDATE again.

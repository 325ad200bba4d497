"""read-only role for `ballast sql`

Revision ID: 0002_readonly_role
Revises: 0001_initial

On PostgreSQL `ballast sql` logs in as ballast_readonly (a SELECT-only role with LOGIN and no password),
so the database refuses writes by privilege as well as by the read-only transaction. Roles are cluster-wide: several
Ballast databases may share the role, so it is created only if missing and never dropped; only this
database's grants are revoked on downgrade. SQLite has no roles: a no-op there.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002_readonly_role"
down_revision: str | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ROLE = "ballast_readonly"


def _is_postgres() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    if not _is_postgres():
        return
    # Two databases migrating at once can race on CREATE ROLE; the loser sees a duplicate and moves on.
    op.execute(
        f"""
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                CREATE ROLE {ROLE} LOGIN;
            END IF;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END
        $$
        """
    )
    op.execute(f"GRANT USAGE ON SCHEMA public TO {ROLE}")
    op.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {ROLE}")
    # SELECT on a sequence reads last_value only; nextval needs USAGE and setval UPDATE, never granted.
    op.execute(f"GRANT SELECT ON ALL SEQUENCES IN SCHEMA public TO {ROLE}")
    op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON SEQUENCES TO {ROLE}")
    # Tables created by later migrations (run by this same user) are readable too.
    op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO {ROLE}")
    # `ballast sql` logs in as this role (no password: trust/peer authentication only, until an
    # operator sets one), because a privileged login could switch back from SET ROLE.
    op.execute(
        f"""
        DO $$
        BEGIN
            IF NOT (SELECT rolcanlogin FROM pg_roles WHERE rolname = '{ROLE}') THEN
                ALTER ROLE {ROLE} LOGIN;
            END IF;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE EXCEPTION 'cannot let role {ROLE} log in as %', current_user
                USING HINT = 'as a superuser run: ALTER ROLE {ROLE} LOGIN';
        END
        $$
        """
    )


def downgrade() -> None:
    if not _is_postgres():
        return
    # Membership and the role itself stay: they are cluster-wide and other databases may use them.
    op.execute(
        f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE SELECT ON TABLES FROM {ROLE};
                ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE SELECT ON SEQUENCES FROM {ROLE};
                REVOKE SELECT ON ALL SEQUENCES IN SCHEMA public FROM {ROLE};
                REVOKE SELECT ON ALL TABLES IN SCHEMA public FROM {ROLE};
                REVOKE USAGE ON SCHEMA public FROM {ROLE};
            END IF;
        END
        $$
        """
    )

-- Uploaded files' metadata (DESIGN §12), written by the writer from `file_put` and
-- `file_delete` ops; the bytes live in the blob store. A deleted file keeps its row
-- (deleted_at set): its blobs are swept later, once no stored message refers to it, and
-- the sweep records that with a `file_swept` op (swept_at).
CREATE TABLE files (
    id uuid PRIMARY KEY,
    owner text NOT NULL,
    name text NOT NULL,
    mime text NOT NULL,
    kind text NOT NULL,
    bytes bigint NOT NULL,
    sha256 text NOT NULL,
    width int4,
    height int4,
    markdown_chars int8,
    note text,
    -- The type of the bytes an image is sent as, when they are a re-encoded copy.
    sent_mime text,
    created_at timestamptz NOT NULL,
    deleted_at timestamptz,
    -- When the sweep removed a deleted file's blobs.
    swept_at timestamptz
);
CREATE INDEX files_owner_live ON files (owner, created_at DESC, id) WHERE deleted_at IS NULL;
CREATE INDEX files_owner_bytes ON files (owner, sha256) WHERE deleted_at IS NULL;
CREATE INDEX files_unswept ON files (deleted_at, id) WHERE deleted_at IS NOT NULL AND swept_at IS NULL;

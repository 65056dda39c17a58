//! `lwio publish URL NAME (--file PATH | --size N)`: publish registered
//! memory as `EXPORT/.lwio-mem/NAME` (docs/memory-objects.md) and serve it
//! until SIGINT/SIGTERM; then unpublish, and with `--out` write the final
//! contents.

use std::io::{Read, Write};
use std::time::Duration;

use super::{catch_interrupts, connect_data, describe, interrupted};
use crate::cli::PublishArgs;
use lwio_client::{ClientOptions, Completion, MemRights};

pub fn run(a: PublishArgs) -> anyhow::Result<()> {
    let export = a.url.require_export()?.to_string();
    if !a.url.path.is_empty() {
        anyhow::bail!(
            "{}: give the export only (lwio://HOST/EXPORT); the name is the next argument",
            a.url
        );
    }
    let len = match (&a.file, a.size) {
        (Some(p), _) => std::fs::metadata(p)
            .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?
            .len(),
        (None, Some(n)) => n,
        (None, None) => anyhow::bail!("give --file PATH or --size N"),
    };
    if len == 0 {
        anyhow::bail!("a memory object cannot be empty");
    }
    let len = usize::try_from(len).map_err(|_| anyhow::anyhow!("{len} bytes: too large"))?;
    catch_interrupts();
    let d = ClientOptions::default();
    let opts = ClientOptions {
        completion: Completion::Interrupt,
        // The published buffer is registered through the registration
        // cache, which refuses a buffer larger than itself.
        reg_cache_bytes: d.reg_cache_bytes.max(len),
        ..d
    };
    let client = connect_data(&a.url, &a.client, opts)?;
    let mut buf = client
        .register_buffer(len)
        .map_err(|e| anyhow::anyhow!("registering {len} bytes: {}", describe(&e)))?;
    if let Some(p) = &a.file {
        std::fs::File::open(p)
            .and_then(|mut f| f.read_exact(&mut buf[..]))
            .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
    }
    let rights = if a.read_only {
        MemRights::ReadOnly
    } else {
        MemRights::ReadWrite
    };
    let published = client
        .publish(&format!("{export}/{}", a.name), buf, rights)
        .map_err(|e| anyhow::anyhow!("publishing {}: {}", a.name, describe(&e.error)))?;
    let url = format!("lwio://{}/{}", a.url.authority(), published.path());
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{url}")?;
        out.flush()?;
    }
    eprintln!(
        "publishing {len} bytes ({}) as {url}; Ctrl-C or SIGTERM to stop",
        if a.read_only {
            "read-only"
        } else {
            "read-write"
        }
    );
    // The server serves it; this process only keeps its memory and its
    // connection alive. Check now and then that the side channel is up.
    let mut ticks = 0u32;
    while !interrupted() {
        std::thread::sleep(Duration::from_millis(50));
        ticks += 1;
        if ticks.is_multiple_of(600) {
            if let Err(e) = client.side(|s| s.ping()) {
                anyhow::bail!("lost the server: {}", describe(&e));
            }
        }
    }
    let buf = published
        .unpublish()
        .map_err(|e| anyhow::anyhow!("unpublishing {}: {}", a.name, describe(&e)))?;
    eprintln!("unpublished {url}");
    if let Some(p) = &a.out {
        std::fs::write(p, &buf[..]).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
    }
    Ok(())
}

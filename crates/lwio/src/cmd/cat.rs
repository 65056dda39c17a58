//! `lwio cat URL`: a remote file to standard output.
//!
//! A reader thread issues large `read_at` calls (each split by the client
//! into pipelined READ requests, several in flight) while the main thread
//! writes the previous chunk to stdout.

use std::io::Write;

use super::{connect_data, ctx, pump, RemoteReader};
use crate::cli::CatArgs;
use lwio_client::OpenOptions;

pub fn run(a: CatArgs) -> anyhow::Result<()> {
    let export = a.url.require_export()?.to_string();
    super::catch_interrupts();
    let client = connect_data(&a.url, &a.client, super::bulk_options())?;
    let full = format!("{export}/{}", a.url.path);
    let file = client
        .open(&full, &OpenOptions::read_only())
        .map_err(|e| ctx(&a.url, e))?;
    let reader = RemoteReader {
        file: &file,
        name: a.url.to_string(),
    };
    let mut out = std::io::stdout().lock();
    let hidden = indicatif::ProgressBar::hidden();
    let r = pump(&reader, &hidden, |buf, _off| match out.write_all(buf) {
        Ok(()) => Ok(true),
        // `lwio cat … | head`: the reader went away; stop quietly.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(anyhow::anyhow!("writing to standard output: {e}")),
    });
    let flushed = match out.flush() {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::anyhow!("writing to standard output: {e}"))
        }
        _ => Ok(()),
    };
    let closed = file.close().map_err(|e| ctx(&a.url, e));
    r?;
    flushed?;
    closed
}

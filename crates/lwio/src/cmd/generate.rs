//! `lwio generate man DIR` / `lwio generate completions DIR` (hidden; for
//! packaging): the man pages and shell completions, from the clap
//! definitions, so they cannot drift from `--help`. lwio.toml(5) and
//! liblwio(3) are docs/config.md and docs/capi.md turned into roff.

use std::io::Write;
use std::path::Path;

use anyhow::Context;
use clap::CommandFactory;

use crate::cli::{Cli, GenerateArgs, GenerateWhat};

const CONFIG_MD: &str = include_str!("../../../../docs/config.md");
const CAPI_MD: &str = include_str!("../../../../docs/capi.md");
const MANUAL: &str = "lwio manual";

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    match a.what {
        GenerateWhat::Man { dir } => {
            let files = man_pages(&dir)?;
            println!("lwio: wrote {} man pages in {}", files.len(), dir.display());
        }
        GenerateWhat::Completions { dir } => {
            let files = completions(&dir)?;
            println!(
                "lwio: wrote {} completions in {}",
                files.len(),
                dir.display()
            );
        }
    }
    Ok(())
}

fn create(dir: &Path, name: &str, data: &[u8]) -> anyhow::Result<String> {
    let p = dir.join(name);
    std::fs::write(&p, data).with_context(|| format!("writing {}", p.display()))?;
    Ok(name.to_string())
}

/// The visible subcommands of `lwio`, in `--help` order.
pub fn subcommand_names() -> Vec<String> {
    Cli::command()
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .map(|s| s.get_name().to_string())
        .collect()
}

/// Write lwio.1, lwio-SUB.1 for every visible subcommand, lwio.toml.5 and
/// liblwio.3 into `dir` (created). Returns the file names.
pub fn man_pages(dir: &Path) -> anyhow::Result<Vec<String>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut cmd = Cli::command()
        .disable_help_subcommand(true)
        .about("RDMA I/O offload: serve files, and read and write them over RDMA");
    cmd.build();
    let subs: Vec<String> = subcommand_names();
    let mut see_also: Vec<String> = subs.iter().map(|s| format!("lwio-{s}(1)")).collect();
    see_also.extend(["lwio.toml(5)".into(), "liblwio(3)".into()]);
    let version = cmd.get_version().unwrap_or("").to_string();
    let page = |c: clap::Command, also: &[String]| -> anyhow::Result<Vec<u8>> {
        let mut buf = Vec::new();
        clap_mangen::Man::new(c)
            .source(format!("lwio {version}"))
            .manual(MANUAL)
            .render(&mut buf)?;
        writeln!(buf, ".SH \"SEE ALSO\"")?;
        writeln!(buf, "{}", also.join(", ").replace('-', "\\-"))?;
        Ok(buf)
    };
    let mut files = Vec::new();
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let also = ["lwio(1)".to_string(), "lwio.toml(5)".into()];
        let name = format!("{}.1", sub.get_display_name().unwrap_or(sub.get_name()));
        files.push(create(dir, &name, &page(sub.clone(), &also)?)?);
    }
    files.push(create(dir, "lwio.1", &page(cmd.clone(), &see_also)?)?);
    files.push(create(
        dir,
        "lwio.toml.5",
        md_to_man(
            "LWIO.TOML",
            "5",
            "lwio.toml \\- configuration file of lwio serve",
            CONFIG_MD,
            &version,
            "lwio(1), lwio-serve(1)",
        )
        .as_bytes(),
    )?);
    files.push(create(
        dir,
        "liblwio.3",
        md_to_man(
            "LIBLWIO",
            "3",
            "liblwio \\- the lwio client as a C library (lwio.h, \\-llwio)",
            CAPI_MD,
            &version,
            "lwio(1), pkg-config(1)",
        )
        .as_bytes(),
    )?);
    Ok(files)
}

/// Write completions for bash (`lwio`), zsh (`_lwio`) and fish
/// (`lwio.fish`) into `dir` (created). Returns the file names.
pub fn completions(dir: &Path) -> anyhow::Result<Vec<String>> {
    use clap_complete::Shell;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut files = Vec::new();
    for (shell, name) in [
        (Shell::Bash, "lwio"),
        (Shell::Zsh, "_lwio"),
        (Shell::Fish, "lwio.fish"),
    ] {
        let mut buf = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "lwio", &mut buf);
        files.push(create(dir, name, &buf)?);
    }
    Ok(files)
}

/// Text for roff: backslashes escaped, and inline markdown (`code`,
/// **bold**, [links](...)) as fonts.
fn inline(s: &str) -> String {
    let s = s.replace('\\', "\\e");
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    let mut code = false;
    let mut bold = false;
    while let Some(c) = chars.next() {
        match c {
            '`' => {
                out.push_str(if code { "\\fR" } else { "\\fB" });
                code = !code;
            }
            '*' if !code && chars.peek() == Some(&'*') => {
                chars.next();
                out.push_str(if bold { "\\fR" } else { "\\fB" });
                bold = !bold;
            }
            '[' if !code => {
                // [text](target) → text
                let rest: String = chars.clone().collect();
                if let Some(close) = rest.find("](") {
                    if let Some(end) = rest[close..].find(')') {
                        out.push_str(&rest[..close]);
                        for _ in 0..close + end + 1 {
                            chars.next();
                        }
                        continue;
                    }
                }
                out.push(c);
            }
            _ => out.push(c),
        }
    }
    if code || bold {
        out.push_str("\\fR");
    }
    line_start(&out)
}

/// A roff text line must not start with a control character.
fn line_start(s: &str) -> String {
    if s.starts_with('.') || s.starts_with('\'') {
        format!("\\&{s}")
    } else {
        s.to_string()
    }
}

fn cells(row: &str) -> Vec<String> {
    row.trim()
        .trim_matches('|')
        .split(" | ")
        .map(|c| c.trim().trim_matches('|').trim().to_string())
        .collect()
}

/// A markdown document (as docs/*.md are written: headings, paragraphs,
/// bullet lists, tables, fenced code) as a man page.
pub fn md_to_man(
    title: &str,
    section: &str,
    name: &str,
    md: &str,
    version: &str,
    see_also: &str,
) -> String {
    let mut out = format!(
        ".TH {title} {section} \"\" \"lwio {version}\" \"{MANUAL}\"\n.SH NAME\n{name}\n.SH DESCRIPTION\n"
    );
    let mut in_code = false;
    let mut header: Option<Vec<String>> = None;
    for line in md.lines() {
        if line.starts_with("```") {
            out.push_str(if in_code {
                ".fi\n.RE\n"
            } else {
                ".RS 4\n.nf\n"
            });
            in_code = !in_code;
            continue;
        }
        if in_code {
            out.push_str(&line_start(&line.replace('\\', "\\e")));
            out.push('\n');
            continue;
        }
        let t = line.trim_start_matches("> ");
        if t.starts_with('|') {
            if t.chars().all(|ch| "|-: ".contains(ch)) {
                continue;
            }
            let row = cells(t);
            match &header {
                None => header = Some(row),
                Some(h) => {
                    let mut tag = inline(&row[0]);
                    if row.len() > 2 {
                        let mid: Vec<String> = row[1..row.len() - 1]
                            .iter()
                            .zip(h.iter().skip(1))
                            .filter(|(v, _)| !v.is_empty() && v.as_str() != "—")
                            .map(|(v, k)| format!("{}: {}", k, inline(v)))
                            .collect();
                        if !mid.is_empty() {
                            tag = format!("{tag} ({})", mid.join("; "));
                        }
                    }
                    let body = row.last().filter(|_| row.len() > 1).map(|b| inline(b));
                    out.push_str(&format!(".TP\n{tag}\n{}\n", body.unwrap_or_default()));
                }
            }
            continue;
        }
        header = None;
        if t.starts_with("# ") {
            continue;
        } else if let Some(h) = t.strip_prefix("## ") {
            out.push_str(&format!(".SH \"{}\"\n", h.to_uppercase().replace('`', "")));
        } else if let Some(h) = t.strip_prefix("### ") {
            out.push_str(&format!(".SS \"{}\"\n", h.replace('`', "")));
        } else if let Some(item) = t.strip_prefix("* ").or_else(|| t.strip_prefix("- ")) {
            out.push_str(&format!(".IP \\(bu 2\n{}\n", inline(item)));
        } else if t.trim().is_empty() {
            out.push_str(".PP\n");
        } else {
            out.push_str(&inline(t.trim_start()));
            out.push('\n');
        }
    }
    out.push_str(&format!(".SH \"SEE ALSO\"\n{see_also}\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_becomes_roff() {
        let md = "# T\n\n## Keys\n\nUse `listen` and **not** [x](y.md).\n\n| key | type | meaning |\n|-----|------|---------|\n| `a` | int | the a |\n\n* one\n\n```\n.dot\n```\n";
        let r = md_to_man("X", "5", "x \\- y", md, "1", "z(1)");
        assert!(r.starts_with(".TH X 5 "), "{r}");
        assert!(r.contains(".SH \"KEYS\"\n"), "{r}");
        assert!(r.contains("Use \\fBlisten\\fR and \\fBnot\\fR x.\n"), "{r}");
        assert!(r.contains(".TP\n\\fBa\\fR (type: int)\nthe a\n"), "{r}");
        assert!(r.contains(".IP \\(bu 2\none\n"), "{r}");
        assert!(r.contains(".RS 4\n.nf\n\\&.dot\n.fi\n.RE\n"), "{r}");
        assert!(r.ends_with(".SH \"SEE ALSO\"\nz(1)\n"), "{r}");
    }
}

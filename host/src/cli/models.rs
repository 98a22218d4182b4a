//! `host models`: the models the Hugging Face cache holds (name, revisions, type,
//! quantization, size), which `--model org/name` can serve.

use crate::load::hub;
use anyhow::Result;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// One JSON object per model instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let root = hub::cache_root()?;
    let models = hub::list(&root);
    if args.json {
        for m in &models {
            println!("{}", serde_json::to_string(m)?);
        }
        return Ok(());
    }
    if models.is_empty() {
        println!("no models in the Hugging Face cache at {}", root.display());
        return Ok(());
    }
    let rows: Vec<[String; 5]> = models
        .iter()
        .map(|m| {
            let size = format!("{:.2} GB", m.bytes as f64 / 1e9);
            [m.name.clone(), m.revisions.join(","), m.model_type.clone(), m.quantization.clone(), size]
        })
        .collect();
    let header = ["NAME", "REVISIONS", "TYPE", "QUANTIZATION", "SIZE"];
    let widths: Vec<usize> =
        (0..5).map(|i| rows.iter().map(|r| r[i].chars().count()).chain([header[i].len()]).max().unwrap_or(0)).collect();
    let line = |cells: &[String]| {
        cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect::<Vec<_>>().join("  ").trim_end().to_string()
    };
    println!("{}", line(&header.map(String::from)));
    for r in &rows {
        println!("{}", line(r));
    }
    println!("({} in {})", models.len(), root.display());
    Ok(())
}

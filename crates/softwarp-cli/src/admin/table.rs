//! A plain text table with aligned columns, as `rdma resource show` and `ss` print them.
//! No I/O besides writing the rendered text.

use std::io::{self, Write};

/// Rows of cells under a header; every column as wide as its widest cell, the last one not
/// padded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table with these column names.
    pub fn new(header: &[&str]) -> Self {
        Self {
            header: header.iter().map(|h| (*h).to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (missing cells are empty, extra cells are dropped).
    pub fn push(&mut self, row: Vec<String>) {
        let mut row = row;
        row.resize(self.header.len(), String::new());
        self.rows.push(row);
    }

    /// Rows added.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether no row was added.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Writes the header and the rows, columns separated by two spaces.
    pub fn render(&self, out: &mut dyn Write) -> io::Result<()> {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::new();
            let last = cells.len().saturating_sub(1);
            for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
                if i == last {
                    s.push_str(cell);
                } else {
                    s.push_str(cell);
                    let pad = w.saturating_sub(cell.chars().count()) + 2;
                    s.extend(std::iter::repeat_n(' ', pad));
                }
            }
            s.truncate(s.trim_end().len());
            s
        };
        writeln!(out, "{}", line(&self.header))?;
        for row in &self.rows {
            writeln!(out, "{}", line(row))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_on_the_widest_cell() {
        let mut t = Table::new(&["PID", "KIND", "DETAILS"]);
        t.push(vec!["1".into(), "qp".into(), "a=1".into()]);
        t.push(vec!["12345".into(), "listener".into()]);
        let mut out = Vec::new();
        t.render(&mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "PID    KIND      DETAILS\n1      qp        a=1\n12345  listener\n"
        );
        assert_eq!(t.len(), 2);
    }
}
